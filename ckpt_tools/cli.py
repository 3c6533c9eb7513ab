"""The `ckpt` command: parse -> call one function -> print. Errors become one line and exit 1."""
from __future__ import annotations

import functools
import os
import sys

import click

from ckpt_tools.errors import CkptError, ConfigError

FORMS = ("ours", "torch_dist", "torch", "fsdp_dtensor", "torch_dcp")  # request.CHOICES (tested), for a fast --help
MODELS = ("gpt", "hybrid")  # request.GPT, HYBRID, without importing its modules for --help


def one_line(message: str) -> str:
    """An error is one line, even when it quotes a damaged file's bytes."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


def _handle_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        ctx = click.get_current_context()
        try:
            return fn(*args, **kwargs)
        except CkptError as e:
            from ckpt_tools.team import ENV, Team, said_by
            if ctx.find_root().params.get("debug"):
                if os.environ.get(ENV) == "1":
                    Team.from_env().announce(e)
                raise
            if os.environ.get(ENV) == "1":  # one process of a team: the others hear of it, one of them says it
                team = Team.from_env()
                team.announce(e)
                said = said_by(e, team)
                if said is not None:
                    click.echo(f"error{said[0]}: {one_line(said[1])}", err=True)
                ctx.exit(1)
            click.echo(f"error: {one_line(str(e))}", err=True)
            ctx.exit(1)
    return wrapper


def _team_opts(fn):
    """The launcher's options of the verbs that write with several processes (ckpt_tools.team)."""
    for name, kind, words in reversed([
            ("--nproc-per-node", int, "Write the output with N processes on this node, each its share of the files; "
                                      "the source and OUT on a filesystem every process sees."),
            ("--nnodes", int, "Nodes taking part (default 1); run the same command on each, with its --node-rank."),
            ("--node-rank", int, "This node's rank (default 0)."),
            ("--master-addr", str, "Node 0's address, for the rendezvous (default 127.0.0.1)."),
            ("--master-port", int, "A free port on node 0 (default: a free one; give it with --nnodes > 1).")]):
        fn = click.option(name, type=click.IntRange(min=1) if name in ("--nproc-per-node", "--nnodes") else kind,
                          default=None, help=words)(fn)
    return fn


def _team(nproc_per_node: int | None, nnodes: int | None, node_rank: int | None, master_addr: str | None,
          master_port: int | None):
    """This process's team: one of the processes the launcher started, or itself alone; None when this process
    has just launched the team, which has done the work (a failed team exits with its code here). The team runs
    this process's own command line (sys.argv): `ckpt` as a command, not click's `main(args=...)` in a program."""
    from ckpt_tools.team import ENV, SOLO, Team, launch
    if os.environ.get(ENV) == "1":
        return Team.from_env()
    if (nproc_per_node or 1) == 1 and (nnodes or 1) == 1:
        return SOLO
    code = launch(sys.argv[1:], nproc_per_node or 1, nnodes or 1, node_rank or 0, master_addr, master_port)
    if code:
        click.get_current_context().exit(code)
    return None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.option("--trust-pickle", is_flag=True,
              help="Load files with full unpickling, which lets them run code: only for files you trust.")
def main(debug: bool, trust_pickle: bool) -> None:
    """Merge, reshard, import, verify and inspect sharded Megatron checkpoints; train with the bundled trainer."""
    from ckpt_tools import io, memory
    memory.return_freed_memory()
    if trust_pickle:
        io.TRUST_PICKLE = True
        click.echo("warning: --trust-pickle: checkpoint files are fully unpickled and can run code", err=True)


@main.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="YAML run config.")
@click.option("--tp", type=int, default=None, help="Override tp_degree.")
@click.option("--pp", type=int, default=None, help="Override pp_degree.")
@click.option("--dp", type=int, default=None, help="Data-parallel size (world = TP x PP x DP; default 1, or "
                                                      "an Accelerate config's num_processes / (TP x PP)).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override any config key.")
@click.option("--accelerate-config", type=click.Path(dir_okay=False), default=None,
              help="An Accelerate config (MEGATRON_LM) for parallelism, precision and launch (docs/accelerate.md).")
@click.option("--nnodes", type=int, default=None, help="torchrun: number of nodes (default 1).")
@click.option("--node-rank", type=int, default=None, help="torchrun: this node's rank (default 0).")
@click.option("--master-addr", default=None, help="torchrun: rendezvous address (default 127.0.0.1).")
@click.option("--master-port", type=int, default=None, help="torchrun: rendezvous port (default: a free one).")
@_handle_errors
def train(config_path: str, tp: int | None, pp: int | None, dp: int | None, overrides: tuple[str, ...],
          accelerate_config: str | None, nnodes: int | None, node_rank: int | None, master_addr: str | None,
          master_port: int | None) -> None:
    """Train with the bundled trainer: launches torchrun with TP x PP x DP processes."""
    import subprocess

    from trainer.launch import launch_command
    sets = list(overrides) + ([f"tp_degree={tp}"] if tp else []) + ([f"pp_degree={pp}"] if pp else [])
    cmd = launch_command(config_path, sets, dp, nnodes, node_rank, master_addr, master_port, accelerate_config)
    click.echo("launching: " + " ".join(cmd[2:]), err=True)
    code = subprocess.call(cmd, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if code:
        raise CkptError(f"training failed (torchrun exit code {code}): see the rank messages above")


@main.command()
@click.argument("src", type=click.Path())
@click.option("--tensors", is_flag=True, help="Also list every tensor with its full shape and split.")
@click.option("--vocab-size", type=int, default=None, help="True vocab size, for inputs that do not record it.")
@click.option("--plan", "nproc", type=int, default=None,
              help="How N processes (--nproc-per-node x --nnodes) split the work on SRC, and the time it takes.")
@click.option("--bandwidth", type=float, default=None,
              help="With --plan: the node's disk bandwidth in MB/s (default: measured by a short copy of SRC).")
@_handle_errors
def inspect(src: str, tensors: bool, vocab_size: int | None, nproc: int | None, bandwidth: float | None) -> None:
    """Summarize a checkpoint: architecture, sizes, layout, files, dtype, iteration, parameters, bytes."""
    from ckpt_tools.verbs.inspect import describe, team_plan
    click.echo(describe(src, show_tensors=tensors, vocab_size=vocab_size))
    if nproc is not None:
        click.echo(team_plan(src, nproc, bandwidth, vocab_size))
    elif bandwidth is not None:
        raise click.BadParameter("--bandwidth goes with --plan N", param_hint="--bandwidth")


def _quiet_opt(fn):
    return click.option("--quiet", "-q", is_flag=True, help="No progress bars.")(fn)


def _safety_opts(fn):
    fn = click.option("--no-preflight", is_flag=True, help="Skip the free-disk check before writing.")(fn)
    return click.option("--check-hashes", is_flag=True,
                        help="Check every file's size and content hash against meta.json before writing.")(fn)


@main.command()
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["hf", "hf-bin", "safetensors", "torch"]), default="hf",
              show_default=True, help="hf: a transformers model dir; hf-bin: the same with pytorch_model*.bin weights; "
                                      "safetensors: one file with megatron-core names; torch: one pytorch_model.bin "
                                      "(HF names).")
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Output dtype (default: the checkpoint's; fp32 with --from-master-weights).")
@click.option("--from-master-weights", is_flag=True, help="Take the fp32 master weights from the optimizer shards.")
@click.option("--max-shard-size", default="5GB", show_default=True, help="Split HF weights into files of this size.")
@click.option("--fp8-blocks", default=None, metavar="ROWSxCOLS",
              help="Write the decoder layers' linear weights as block-scaled FP8 (e4m3 + weight_scale_inv per block, "
                   "DeepSeek-V3's published layout), e.g. 128x128; the other tensors in --dtype.")
@click.option("--mxfp4", is_flag=True,
              help="Write the experts' weights in MXFP4 (_blocks and _scales, GPT-OSS's published layout); the other "
                   "tensors in --dtype.")
@click.option("--tokenizer", type=click.Path(file_okay=False), default=None,
              help="Tokenizer dir to include (default: the checkpoint's own tokenizer files).")
@click.option("--vocab-size", type=int, default=None, help="True vocab size, for inputs that do not record it.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@_safety_opts
@_quiet_opt
@_team_opts
@_handle_errors
def merge(src: str, out: str, fmt: str, dtype: str | None, from_master_weights: bool, max_shard_size: str,
          fp8_blocks: str | None, mxfp4: bool, tokenizer: str | None, vocab_size: int | None, force: bool, check_hashes: bool,
          no_preflight: bool, quiet: bool, **launcher) -> None:
    """Merge a sharded checkpoint into one HuggingFace model dir (or one safetensors file)."""
    # no torch imported here: a merge that needs none never imports it (a team of processes does, for its rendezvous)
    from ckpt_tools.verbs import merge as m
    from ckpt_tools.verbs.plan import parse_size
    team = _team(**launcher)
    if team is None:
        return
    quiet = quiet or not team.lead  # one progress bar: process 0's
    summary = m.merge(src, out, fmt=fmt, dtype=dtype, from_master=from_master_weights,
                      max_shard_size=parse_size(max_shard_size), tokenizer=tokenizer, vocab_size=vocab_size,
                      force=force, quiet=quiet, check_hashes=check_hashes, no_preflight=no_preflight,
                      torch_threads=1, team=team, fp8_blocks=_blocks(fp8_blocks), mxfp4=mxfp4)
    if team.lead:
        click.echo(summary)


def _blocks(text: str | None) -> tuple[int, int] | None:
    """--fp8-blocks: '128x128', '128,128' or '128' (square)."""
    if text is None:
        return None
    parts = text.lower().replace(",", "x").split("x")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2) or min(sizes) < 1:
        raise ConfigError(f"--fp8-blocks {text!r}: give the block as ROWSxCOLS (e.g. 128x128) or one size")
    return (sizes[0], sizes[-1])


_vpp_opt = click.option(
    "--vpp", type=int, default=1, show_default=True,
    help="Model chunks per PP rank: an interleaved pipeline (Megatron-LM's --num-layers-per-virtual-pipeline-stage, "
         "an even split; --format torch_dist or torch).")


def _layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r}: give comma-separated layer counts, e.g. 3,5") from None


@main.command()
@click.argument("src", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--tp", type=int, required=True, help="Target tensor-parallel size.")
@click.option("--pp", type=int, required=True, help="Target pipeline-parallel size.")
@click.option("--ep", type=int, default=None,
              help="Target expert-parallel size (MoE models; ours or --format torch; default: the source's).")
@click.option("--layers-per-stage", default=None, help="Uneven layer split, e.g. 3,5 (default: even).")
@_vpp_opt
@click.option("--vocab-size", type=int, default=None, help="True vocab size, for inputs that do not record it.")
@click.option("--format", "form", type=click.Choice(FORMS), default=FORMS[0], show_default=True,
              help="ours (pytorch_model_tp_X_pp_Y.bin), or Megatron-LM's --ckpt-format torch_dist / torch / fsdp_dtensor "
                   "(Megatron-FSDP); torch_dcp is refused, with the reason (Megatron-LM cannot load one).")
@click.option("--no-optimizer", is_flag=True, help="Write the weights only.")
@click.option("--model", type=click.Choice(MODELS), default=None,
              help="The megatron-core model class of a Megatron-LM output: gpt (GPTModel) or hybrid (HybridModel, "
                   "its --hybrid-layer-pattern '*-*-...'; torch_dist) Default: the source's.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@_safety_opts
@_quiet_opt
@_team_opts
@_handle_errors
def reshard(src: str, out: str, tp: int, pp: int, ep: int | None, layers_per_stage: str | None, vpp: int,
            vocab_size: int | None, form: str, no_optimizer: bool, model: str | None, force: bool, check_hashes: bool,
            no_preflight: bool, quiet: bool, **launcher) -> None:
    """Rewrite a checkpoint (model + optimizer) at another TP x PP layout, into a save dir OUT."""
    from ckpt_tools.verbs.request import Request
    want = Request(tp, pp, _layers(layers_per_stage), ep, vpp, form, model, not no_optimizer).check()
    team = _team(**launcher)
    if team is None:
        return
    quiet = quiet or not team.lead  # one progress bar: process 0's
    from ckpt_tools.verbs import paths
    summary = paths.reshard(src, out, want, vocab_size, force, quiet, check_hashes, no_preflight, team, tuned=True)
    if team.lead:
        click.echo(summary)


@main.command("import")
@click.argument("hf_dir", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--tp", type=int, default=1, show_default=True, help="Target tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Target pipeline-parallel size.")
@click.option("--ep", type=int, default=1, show_default=True,
              help="Target expert-parallel size (MoE models; ours or --format torch).")
@click.option("--layers-per-stage", default=None, help="Uneven layer split, e.g. 3,5 (default: even).")
@_vpp_opt
@click.option("--dtype", type=click.Choice(["bf16", "fp16", "fp32"]), default=None,
              help="Model weight dtype (default: the HF weights' own).")
@click.option("--format", "form", type=click.Choice(FORMS), default=FORMS[0], show_default=True,
              help="ours, or a Megatron-LM save dir (--ckpt-format torch_dist / torch / fsdp_dtensor; the weights, as a "
                   "'release'); torch_dcp is refused, with the reason (Megatron-LM cannot load one).")
@click.option("--no-optimizer", is_flag=True, help="Write no optimizer state (the trainer then starts AdamW fresh).")
@click.option("--model", type=click.Choice(MODELS), default=None,
              help="The megatron-core model class of a Megatron-LM output: gpt (GPTModel) or hybrid (HybridModel, "
                   "its --hybrid-layer-pattern '*-*-...'; torch_dist) Default: gpt.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@_quiet_opt
@_team_opts
@_handle_errors
def import_(hf_dir: str, out: str, tp: int, pp: int, ep: int, layers_per_stage: str | None, vpp: int,
            dtype: str | None,
            form: str, no_optimizer: bool, model: str | None, force: bool, quiet: bool, **launcher) -> None:
    """Import a HuggingFace model (docs/families.md) into sharded checkpoints (a save dir OUT)."""
    from ckpt_tools.verbs.plan import DTYPE_OPTIONS
    from ckpt_tools.verbs.request import Request
    want = Request(tp, pp, _layers(layers_per_stage), ep, vpp, form, model, not no_optimizer).check()
    team = _team(**launcher)
    if team is None:
        return
    quiet = quiet or not team.lead  # one progress bar: process 0's
    from ckpt_tools.verbs import paths
    summary = paths.import_hf(hf_dir, out, want, DTYPE_OPTIONS[dtype] if dtype else None, force, quiet, team,
                              tuned=True)
    if team.lead:
        click.echo(summary)


@main.command()
@click.argument("src", type=click.Path())
@click.argument("other", type=click.Path(), required=False)
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default=None, help="Default: cuda when present.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Compute dtype of both forward passes; picks the tolerances.")
@click.option("--tokens", "tokens_file", type=click.Path(dir_okay=False), default=None,
              help="A text file, tokenized with the checkpoint's tokenizer (default: seeded random ids).")
@click.option("--batch", type=int, default=4, show_default=True, help="Sequences per forward.")
@click.option("--seq-len", type=int, default=128, show_default=True, help="Tokens per sequence.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random token ids.")
@click.option("--report", type=click.Path(dir_okay=False), default=None, help="Write an HDF5 report here.")
@click.option("--vocab-size", type=int, default=None, help="True vocab size, for inputs that do not record it.")
@_team_opts
@_handle_errors
def verify(src: str, other: str | None, device: str | None, dtype: str, tokens_file: str | None, batch: int,
           seq_len: int, seed: int, report: str | None, vocab_size: int | None, **launcher) -> None:
    """Prove SRC (sharded) and OTHER (HF dir, safetensors file or checkpoint) are the same model: tiers 1-3."""
    from ckpt_tools.verbs import verify as v
    from ckpt_tools.verbs.tiers import table, write_report
    team = _team(**launcher)
    if team is None:
        return
    tiers, settings = v.run(src, other, device=device, dtype=dtype, tokens_file=tokens_file, batch=batch,
                            seq=seq_len, seed=seed, vocab_size=vocab_size, team=team)
    if not team.lead:
        return  # its share of tier 1 went to process 0, which says the result
    click.echo(table(tiers, settings))
    if report:
        write_report(report, tiers, settings)
        click.echo(f"report: {report}")
    failed = [t for t in tiers if not t.ok]
    if failed:
        from ckpt_tools.team import Alone  # in a team, process 0 says it after the others have ended
        raise (Alone if team.size > 1 else CkptError)(f"verify failed: tier {failed[0].name}: {failed[0].reason}")
    click.echo("verify passed: all tiers within tolerance")


if __name__ == "__main__":
    if os.environ.get("CKPT_TEAM") == "1":  # one process of a team (ckpt_tools.team)
        from ckpt_tools.team import run_worker
        run_worker(main)
    sys.exit(main())
