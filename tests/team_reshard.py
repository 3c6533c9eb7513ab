"""One process of a team resharding through the torch reader (the path a Megatron-LM source's optimizer state
takes), for tests/test_team.py:

    CKPT_TEAM=1 python -m ckpt_tools.team --nproc-per-node N tests/team_reshard.py SRC OUT TP PP FORM
"""
import sys

from ckpt_tools.team import Team, run_worker
from ckpt_tools.verbs.reshard import reshard

src, out, tp, pp, form = sys.argv[1:6]
run_worker(lambda: reshard(src, out, int(tp), int(pp), quiet=True, form=form, copy_bytes=False,
                           team=Team.from_env()))
