"""Checkpoint toolkit for sharded Megatron (TP x PP x DP) training state."""
import warnings

# megatron-core announces at import that Transformer Engine / Apex are absent; the CPU path needs neither.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def package_version(name: str = "ckpt-tools") -> str:
    """An installed distribution's version; 'unknown' when run from a source tree without install."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"
