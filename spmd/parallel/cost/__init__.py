"""What a step costs before it runs: its communication table, memory and compute, the host's measured
rates (``calibrate``) or a device's published ones (``Hardware``), and the collectives a compiled program
executes."""

from spmd.parallel.cost._calibrate import Calibration, calibrate
from spmd.parallel.cost._hardware import HARDWARE, Hardware, Link
from spmd.parallel.cost._hlo import executed_collectives, hlo_executed_collectives

__all__ = ["Calibration", "calibrate", "Hardware", "Link", "HARDWARE", "executed_collectives", "hlo_executed_collectives"]
