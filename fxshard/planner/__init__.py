"""Pick the parallelism for a model: ``fxshard.plan_parallelism`` ranks the meshes of dp, tp,
pp, cp and ep a model can train on by predicted step time, with each one's memory and
communication per rank (docs/planning.md).

Example::

    entries = fxshard.plan_parallelism("path/to/checkpoint", 64, memory_gib=80, seq=8192,
                                       global_batch=512, device="h100")
    print(fxshard.planner.format_table(entries))
    fxshard.planner.best_mesh("path/to/checkpoint", 64, 80, seq=8192, global_batch=512)   # 'dp=64'
"""
from fxshard.planner.api import PlanEntry, best_mesh, format_table, plan_parallelism
from fxshard.planner.calibration import PRESETS, Calibration, Link, calibrate

__all__ = ["plan_parallelism", "best_mesh", "format_table", "PlanEntry", "Calibration", "Link", "calibrate", "PRESETS"]
