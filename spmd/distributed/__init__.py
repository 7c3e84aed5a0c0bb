"""torch.distributed's API on JAX's distributed runtime: ``import spmd.distributed as dist``.

A torch script ports by changing its imports. Each collective RETURNS this
rank's result and, where torch writes into its argument, writes it there too
when the argument is a writable buffer (a NumPy array, a CPU torch tensor); a
JAX array is immutable, so with one write ``t = dist.all_reduce(t)``.
Functions that fill a Python list in torch fill it here too (and return it).

One process is one rank. Run several with ``spmdrun --nproc-per-node N script.py``
(or ``spmd.spawn``); one process without the environment variables is a world
of size 1.
"""

from placements import ReduceOp
from spmd.distributed._backend import Backend
from spmd.distributed._c10d import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from spmd.distributed._errors import PeerError
from spmd.distributed._groups import NotAMemberWarning
from spmd.distributed._p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from spmd.distributed._run import rank_devices
from spmd.distributed._work import DiscardedResultWarning, Work
from spmd.distributed._groups import (
    Group,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    new_group,
)
from spmd.distributed._init import destroy_process_group, init_process_group
from spmd.distributed._state import is_available, is_initialized
from spmd.distributed._objects import (
    all_gather_object,
    barrier,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from spmd._spawn import ProcessExitedException, ProcessRaisedException
# torch names a port uses (issue 12.6), added by helper "port":
from spmd._debug import CommDebugMode
from spmd.tensor._debug import visualize_sharding
from spmd.distributed.device_mesh import DeviceMesh, init_device_mesh
from spmd.distributed._availability import (
    get_default_backend_for_device,
    get_node_local_rank,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    is_ucc_available,
)
from spmd.distributed._coalesced import all_reduce_coalesced
from spmd.distributed._ddp import DistributedDataParallel
from spmd.distributed._object_p2p import monitored_barrier, recv_object_list, send_object_list
from spmd.distributed._store import FileStore, HashStore, PrefixStore, Store, TCPStore
from spmd.distributed._subgroups import new_subgroups, new_subgroups_by_enumeration

reduce_op = ReduceOp  # torch's deprecated alias

__all__ = [
    "DeviceMesh",
    "init_device_mesh",
    "monitored_barrier",
    "send_object_list",
    "recv_object_list",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "all_reduce_coalesced",
    "is_gloo_available",
    "is_nccl_available",
    "is_mpi_available",
    "is_ucc_available",
    "is_torchelastic_launched",
    "get_node_local_rank",
    "get_default_backend_for_device",
    "Store",
    "TCPStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "reduce_op",
    "CommDebugMode",
    "visualize_sharding",
    "DistributedDataParallel",
    "init_process_group",
    "is_initialized",
    "is_available",
    "get_rank",
    "get_world_size",
    "get_backend",
    "destroy_process_group",
    "new_group",
    "group",
    "Group",
    "get_process_group_ranks",
    "get_group_rank",
    "get_global_rank",
    "Backend",
    "ReduceOp",
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce",
    "scatter",
    "gather",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "P2POp",
    "Work",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "rank_devices",
    "PeerError",
    "NotAMemberWarning",
    "DiscardedResultWarning",
    "ProcessRaisedException",
    "ProcessExitedException",
]
