"""Reference layout of megatron-core's own ``GPTModel.state_dict()`` per (tp_rank, pp_rank).

Test helper (not a test file).  ``mcore_state_dict_layout(model, tp, pp)`` builds the
megatron-core 0.16.1 ``GPTModel`` (local spec, ``get_gpt_layer_local_spec``) on CPU in
``tp * pp`` freshly spawned Python processes (gloo backend, localhost) and returns, per
``(tp_rank, pp_rank)``, the ordered list of ``(key, shape, dtype_name)`` of
``GPTModel.state_dict()`` on that rank.  ``shape`` is a tuple of ints and ``dtype_name``
is e.g. ``"float32"`` (``str(tensor.dtype)`` without the ``torch.`` prefix); both are
``None`` for non-tensor entries (``_extra_state``).  Our own trainer's model can then be
compared against it key-for-key, shape-for-shape, in order.

How the reference model is built (see ``_build_model`` in mcore_reference_child.py):

* ``TransformerConfig(num_layers=<total>, ..., layernorm_epsilon=norm_epsilon,
  use_cpu_initialization=True, params_dtype=pipeline_dtype=float32,
  tensor/pipeline_model_parallel_size=tp/pp, dropouts 0)``;
  llama -> RMSNorm, gated_linear_unit + silu (SwiGLU), add_bias_linear=False,
  add_qkv_bias=False; gpt2 -> LayerNorm, gelu, add_bias_linear=True,
  ``num_query_groups = num_attention_heads``.
* ``GPTModel(config, get_gpt_layer_local_spec(normalization=...),
  vocab_size=padded_vocab_size, max_sequence_length=max_position_embeddings,
  pre_process=is_pipeline_first_stage(), post_process=is_pipeline_last_stage(),
  share_embeddings_and_output_weights=tie_word_embeddings (gpt2: True),
  position_embedding_type="rope" + rotary_base (llama) / "learned_absolute" (gpt2))``.
  In megatron-core 0.16.1 ``position_embedding_type`` and ``rotary_base`` are NOT
  ``TransformerConfig`` fields (only of ``MLATransformerConfig``); they are GPTModel
  arguments.  megatron splits ``num_layers`` evenly over the PP stages itself.
* World size is ``tp * pp`` (data-parallel size 1); ranks map to
  ``(tp_rank, pp_rank)`` as reported by ``parallel_state`` in each child.
* CPU-only quirk: with tied embeddings and PP > 1,
  ``LanguageModule.setup_embeddings_and_output_layer`` does ``weight.data.cuda()``
  before all-reducing the embedding copy between first and last stage.  The children
  therefore replace ``torch.Tensor.cuda`` by an identity (the all-reduce then runs over
  gloo on CPU).  ``model_parallel_cuda_manual_seed`` needs CUDA and is not called;
  CPU initialisation uses torch's default RNG (``torch.manual_seed``).

Findings, verified with megatron-core 0.16.1 / torch 2.13 CPU (llama tiny config
num_layers=4, hidden=64, heads=4, groups=2, ffn=96, vocab=1024; and gpt2 tiny):

(a) Tied embeddings, PP > 1: the LAST stage DOES hold ``output_layer.weight``
    (shape ``(vocab/tp, hidden)``, a duplicate of the word embeddings, synchronised by
    an all-reduce over the embedding group at init -- checked: its values equal the
    first stage's word embeddings per TP rank), followed by ``output_layer._extra_state``.  The first stage holds
    ``embedding.word_embeddings.weight`` and no ``output_layer.*``.
(b) Tied embeddings, PP = 1: there is NO ``output_layer.weight``; the only
    ``output_layer`` key is ``output_layer._extra_state`` (value ``None``), the last key
    of the state dict.  (Untied: ``output_layer.weight`` then ``output_layer._extra_state``.)
(c) ``_extra_state`` entries (value ``None``, so shape/dtype ``None``) appear for every
    ``ColumnParallelLinear`` / ``RowParallelLinear``: per layer
    ``self_attention.linear_proj``, ``self_attention.linear_qkv``, ``mlp.linear_fc1``,
    ``mlp.linear_fc2``; plus ``output_layer`` on the last stage (even when its weight is
    tied away).  Norms, embeddings and the rotary embedding have none.  The rotary
    embedding contributes no keys at all (``inv_freq`` is a plain attribute).
(d) Order inside a layer (module registration order of ``TransformerLayer`` /
    ``SelfAttention``): ``input_layernorm.weight`` [``.bias``],
    ``self_attention.linear_proj.weight`` [``.bias``], ``self_attention.linear_proj._extra_state``,
    ``self_attention.linear_qkv.weight`` [``.bias``], ``self_attention.linear_qkv._extra_state``,
    ``pre_mlp_layernorm.weight`` [``.bias``], ``mlp.linear_fc1.weight`` [``.bias``],
    ``mlp.linear_fc1._extra_state``, ``mlp.linear_fc2.weight`` [``.bias``],
    ``mlp.linear_fc2._extra_state``.  I.e. linear_proj BEFORE linear_qkv, weight before
    bias before _extra_state.  Model order: ``embedding.word_embeddings.weight``,
    [``embedding.position_embeddings.weight``], ``decoder.layers.<i>.*`` (local indices
    starting at 0 on every stage), ``decoder.final_layernorm.*`` (last stage only),
    [``output_layer.weight``], ``output_layer._extra_state`` (last stage only).

Other observations: TP-sharded shapes are word embeddings / output layer
``(vocab/tp, hidden)``, ``linear_qkv`` ``((groups/tp) * (heads/groups + 2) * kv_channels,
hidden)`` (grouped [q..q k v] per query group), ``linear_fc1`` ``(2*ffn/tp, hidden)``
for llama (gate and up stacked per rank) or ``(ffn/tp, hidden)`` for gpt2,
``linear_proj`` ``(hidden, heads*kv_channels/tp)``, ``linear_fc2`` ``(hidden, ffn/tp)``.
Replicated (full) on every TP rank: all norm weights/biases, the row-parallel biases
(``linear_proj.bias``, ``linear_fc2.bias``) and gpt2's
``embedding.position_embeddings.weight`` ``(max_position_embeddings, hidden)``.
Column-parallel biases (``linear_qkv.bias``, ``linear_fc1.bias``) are split like their
weight rows.  All tensors are float32.

Robustness: each rank is a subprocess (``python mcore_reference_child.py --child ...``) writing
its result (or its traceback) to a JSON file in a temp dir; stdout/stderr go to per-rank
log files.  The parent polls; if a child fails, the others get a short grace period and
are then killed, and a ``RuntimeError`` carrying the child's traceback is raised.  On
overall timeout (``timeout_s``) every child is killed and ``RuntimeError`` is raised.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from ckpt_tools.ports import free_port
from pathlib import Path

Layout = dict[tuple[int, int], list[tuple[str, "tuple[int, ...] | None", "str | None"]]]

_REQUIRED_KEYS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "padded_vocab_size",
    "max_position_embeddings",
    "norm_epsilon",
)

# Seconds the surviving ranks get to report their own error after one rank failed
# (they are typically blocked in a collective with the dead rank).
_FAILURE_GRACE_S = 5.0


CHILD = Path(__file__).with_name("mcore_reference_child.py")  # what each rank runs

# ----------------------------------------------------------------------------- parent


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                # Each child is its own session leader; kill its whole group (it may have
                # spawned helpers) -- only ever the group of a process we started.
                os.killpg(p.pid, 9)
            except (ProcessLookupError, PermissionError):
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _validate(model: dict, tp: int, pp: int) -> None:
    missing = [k for k in _REQUIRED_KEYS if k not in model]
    if missing:
        raise ValueError(f"model config lacks keys {missing}")
    arch = model["architecture"]
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    if model["num_layers"] % pp:
        raise ValueError(f"num_layers={model['num_layers']} not divisible by pp={pp}")
    for k in ("num_attention_heads", "padded_vocab_size", "ffn_hidden_size"):
        if model[k] % tp:
            raise ValueError(f"{k}={model[k]} not divisible by tp={tp}")
    groups = model["num_attention_heads"] if arch == "gpt2" else model["num_query_groups"]
    if model["num_attention_heads"] % groups:
        # megatron-core 0.16.1 does not check this at construction time (it builds a
        # linear_qkv of heads*kv + 2*groups*kv rows and only fails in forward).
        raise ValueError(
            f"num_attention_heads={model['num_attention_heads']} must be a multiple of "
            f"num_query_groups={groups}"
        )
    if groups % tp:
        raise ValueError(f"num_query_groups={groups} not divisible by tp={tp}")


def _run_once(model: dict, tp: int, pp: int, timeout_s: float) -> tuple[Layout | None, str | None]:
    """Returns (layout, None) or (None, 'retry' reason) for a port clash; raises otherwise."""
    world = tp * pp
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="mcore_ref_") as tmp:
        tmpdir = Path(tmp)
        cfg_path = tmpdir / "config.json"
        cfg_path.write_text(json.dumps({"model": model, "tp": tp, "pp": pp}))
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world),
            PYTHONWARNINGS="ignore",
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            CUDA_VISIBLE_DEVICES="",
            TORCH_CPP_LOG_LEVEL="ERROR",
            PYTHONUNBUFFERED="1",
        )
        if sys.platform.startswith("linux"):
            # Keep gloo on loopback even if the hostname resolves to another interface.
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.pop("LOCAL_RANK", None)
        procs: list[subprocess.Popen] = []
        logs: list = []
        try:
            for rank in range(world):
                log = open(tmpdir / f"rank{rank}.log", "wb")
                logs.append(log)
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(CHILD),
                            "--child",
                            str(rank),
                            str(cfg_path),
                            str(tmpdir / f"rank{rank}.json"),
                        ],
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
            deadline = time.monotonic() + timeout_s
            first_failure: int | None = None
            failure_deadline = None
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                for r, c in enumerate(codes):
                    if c not in (None, 0) and first_failure is None:
                        first_failure = r
                        failure_deadline = time.monotonic() + _FAILURE_GRACE_S
                now = time.monotonic()
                if failure_deadline is not None and now > failure_deadline:
                    break
                if now > deadline:
                    _kill(procs)
                    raise RuntimeError(
                        f"megatron-core reference (tp={tp}, pp={pp}) timed out after "
                        f"{timeout_s:.0f}s; children killed. Exit codes: {codes}.\n"
                        + "\n".join(
                            f"--- rank {r} log tail ---\n{_tail(tmpdir / f'rank{r}.log', 1500)}"
                            for r in range(world)
                        )
                    )
                time.sleep(0.05)
        finally:
            _kill(procs)
            for log in logs:
                log.close()

        results: dict[int, dict] = {}
        raised: list[str] = []
        silent: list[str] = []
        for rank, p in enumerate(procs):
            out = tmpdir / f"rank{rank}.json"
            data = None
            if out.exists():
                try:
                    data = json.loads(out.read_text())
                except ValueError:
                    data = None
            if data is not None and "error" in data:
                raised.append(f"--- rank {rank} raised ---\n{data['error']}")
            elif data is not None and "entries" in data:
                # The layout is complete once written, even if the rank died afterwards
                # (e.g. in the final barrier because a peer failed).
                results[rank] = data
            else:
                silent.append(
                    f"--- rank {rank} exited with code {p.returncode} without a result"
                    f" ---\n{_tail(tmpdir / f'rank{rank}.log')}"
                )
        if raised or silent:
            # Real tracebacks first; ranks killed after the grace period are mostly noise.
            text = "\n".join(raised + silent)
            if "EADDRINUSE" in text or "ddress already in use" in text:
                return None, text
            raise RuntimeError(
                f"megatron-core reference (tp={tp}, pp={pp}) failed in a child process:\n{text}"
            )

    layout: Layout = {}
    for rank in range(world):
        d = results[rank]
        key = (int(d["tp_rank"]), int(d["pp_rank"]))
        if key in layout:
            raise RuntimeError(f"two ranks reported the same (tp_rank, pp_rank) {key}")
        layout[key] = [
            (k, tuple(shape) if shape is not None else None, dtype)
            for k, shape, dtype in d["entries"]
        ]
    return dict(sorted(layout.items())), None


def mcore_state_dict_layout(
    model: dict, tp: int, pp: int, timeout_s: float = 180.0
) -> dict[tuple[int, int], list[tuple[str, tuple[int, ...] | None, str | None]]]:
    """Per (tp_rank, pp_rank): the ordered list of (key, shape, dtype-name) of megatron-core
    GPTModel.state_dict() on that rank; shape and dtype are None for non-tensor entries such
    as `_extra_state` (None or BytesIO)."""
    _validate(model, tp, pp)
    start = time.monotonic()
    last = None
    for _attempt in range(3):  # the free port may be grabbed between probe and bind
        remaining = timeout_s - (time.monotonic() - start)
        if remaining <= 0:
            break
        layout, retry_reason = _run_once(model, tp, pp, remaining)
        if layout is not None:
            return layout
        last = retry_reason
    raise RuntimeError(f"megatron-core reference (tp={tp}, pp={pp}) failed:\n{last}")
