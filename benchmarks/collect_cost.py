"""Instructions spent on stage metrics, counted by callgrind (repeatable where CPU time is not).

Runs 32 synthetic sessions of FRAMES frames with stage metrics on or off; run it under callgrind
at two frame counts and difference the totals, so start-up cancels out:

    valgrind --tool=callgrind --callgrind-out-file=on_72.out python benchmarks/collect_cost.py on 72
    (and: on 8, off 72, off 8; then compare (on_72 - on_8) / (off_72 - off_8))
"""

import sys, trio
from duplexrt.config import load_config
from duplexrt.simulate.runner import SimulateOptions, run_simulation
collect, frames = sys.argv[1] == "on", int(sys.argv[2])
over = ['backend.name="synthetic"', "runtime.slots=32"]
if not collect:
    over += ["metrics.collect_stage_metrics=false", "metrics.log_stats=false"]
rep = trio.run(run_simulation, load_config(None, over), SimulateOptions(concurrency=32, frames=frames))
assert rep.ok
