"""The bundled trainer on megatron-core 0.19 (the newest release) instead of the installed 0.16.1: `python -m trainer`'s
command line, run as

    torchrun --nproc-per-node N tests/trainer_newest.py --config CONFIG [--set KEY=VALUE ...]

MCORE_NEWEST names the unpacked 0.19 wheel (default .venv/megatron-core-0.19.2; on a GPU machine the `pip install
--target` dir of it). On this machine's Python 3.11 and CPU torch it runs as tests/mcore_newest.py explains."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import mcore_newest  # noqa: E402

if __name__ == "__main__":
    if mcore_newest.location() is None:
        sys.exit(f"megatron-core 0.19 is not staged at {mcore_newest.DEFAULT} (scripts/setup_env.sh) nor named by "
                 f"MCORE_NEWEST")
    mcore_newest.activate()
    import megatron.core

    if not megatron.core.__version__.startswith("0.19"):
        sys.exit(f"megatron-core {megatron.core.__version__} was imported from {megatron.core.__file__}, not 0.19")
    from trainer.train import main
    print(f"megatron-core {megatron.core.__version__} from {Path(megatron.core.__file__).parent}", flush=True)
    sys.exit(main(sys.argv[1:]))
