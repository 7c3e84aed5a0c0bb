"""Pipeline parallelism: a model cut into stages over a ``pp`` mesh dim, run by a schedule's tick table
(GPipe, 1F1B, interleaved, ...)."""

from spmd.parallel.pipelining._pipeline import PipelineModule, SplitPoint, pipeline
from spmd.parallel.pipelining._schedules import Schedule, build_schedule

__all__ = ["pipeline", "PipelineModule", "SplitPoint", "Schedule", "build_schedule"]
