"""The scale lane's task: hpc_train's own agent (hpc_train.rank.agent.agent: the coordinator, restarts, spares) over a
lightweight rank (light_rank.py, no torch), so that 64 nodes' worth of agents and ranks fit on one machine."""

import sys
from pathlib import Path

from hpc_train.rank.agent.agent import agent_setup, supervise

run_dir = Path(sys.argv[1])
setup = agent_setup(run_dir)
if setup is None:
    sys.exit(f"{run_dir}: not a job whose agents restart in place (retry.in_place, spares)")
sys.exit(supervise(setup, [sys.executable, "-u", str(Path(__file__).with_name("light_rank.py"))]))
