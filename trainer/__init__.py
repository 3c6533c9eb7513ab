"""The bundled GPT trainer on megatron-core: TP x PP x DP under torchrun."""
import warnings

# megatron-core announces at import that Transformer Engine / Apex are absent; the CPU path needs neither.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
