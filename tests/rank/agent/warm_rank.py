"""A stand-in for a trainer's rank in the warm-restart tests: each life prints one JSON line (its pid, the
``HPC_TRAIN_TEST_LIFE`` of its environment, its arguments, whether its standard input is ``/dev/null``), then
says it is warm and takes the agent's next order in the same process, as ``hpc_train.rank.entry`` does; it leaves
when the agent closes the channel. With ``HPC_TRAIN_TEST_BUSY`` it stays busy instead of saying it is warm."""

from __future__ import annotations

import json
import os
import sys
import time

from hpc_train.rank.agent.rejoin import REJOIN_ENV, RejoinChannel
from hpc_train.rank.agent.standby_main import take_order


def main() -> int:
    channel = RejoinChannel.adopt(os.environ)
    while True:
        line = json.dumps({"pid": os.getpid(), "life": os.environ.get("HPC_TRAIN_TEST_LIFE"), "argv": sys.argv[1:],
                           "stdin_is_null": os.path.samefile("/proc/self/fd/0", os.devnull),
                           "channel": channel is not None, "variable_left": REJOIN_ENV in os.environ})
        os.write(1, (line + "\n").encode())  # one write: another stand-in's line never lands inside it
        if os.environ.get("HPC_TRAIN_TEST_BUSY"):  # a rank computing, which never reaches a failed collective
            time.sleep(120)
        if channel is None or not channel.say_warm():
            return 0
        order = channel.read_order()
        if order is None:
            return 3
        take_order(order)


if __name__ == "__main__":
    sys.exit(main())
