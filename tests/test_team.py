"""merge, reshard and import written by a team of processes (--nproc-per-node, ckpt_tools.team): the output is
byte-identical to one process's, a killed process leaves no complete-looking output and a rerun finishes it, a
failing process stops the others and leaves nothing behind."""
from __future__ import annotations

import hashlib
import itertools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tools import output
from ckpt_tools.ports import free_port
from ckpt_tools.team import split, worker_argv

ROOT = Path(__file__).resolve().parent.parent

# (verb, source, options): every writer a team can run, each output file-by-file compared
CASES = {
    "merge-hf": ("merge", "ours", ["--max-shard-size", "150KB"]),
    "merge-safetensors": ("merge", "ours", ["--format", "safetensors"]),
    "reshard-ours": ("reshard", "ours", ["--tp", "1", "--pp", "3", "--layers-per-stage", "1,1,2"]),
    "reshard-torch_dist-optimizer": ("reshard", "ours", ["--tp", "1", "--pp", "1", "--format", "torch_dist"]),
    "reshard-torch": ("reshard", "ours", ["--tp", "1", "--pp", "2", "--format", "torch", "--no-optimizer"]),
    "import-ours": ("import", "hf", ["--tp", "2", "--pp", "2"]),
    "import-torch_dist": ("import", "hf", ["--tp", "2", "--pp", "1", "--format", "torch_dist"]),
    "import-torch": ("import", "hf", ["--tp", "1", "--pp", "2", "--format", "torch"]),
    # the HF weights are fp32: into torch_dist each tensor made by torch in the process that writes a chunk of it
    # (hf_copy.made_by_torch); into the legacy form each rank's shard made and cast in the process writing its file
    "import-torch_dist-bf16": ("import", "hf", ["--tp", "2", "--pp", "2", "--format", "torch_dist", "--dtype", "bf16"]),
    "import-torch-bf16": ("import", "hf", ["--tp", "2", "--pp", "1", "--format", "torch", "--dtype", "bf16"]),
    # experts over EP ranks: each process reads only the experts of its files
    "import-moe-ep2": ("import", "moe", ["--tp", "1", "--pp", "1", "--ep", "2"]),
}


def ckpt(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ckpt_tools.cli", *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, **(env or {})})
    if check and proc.returncode:
        raise AssertionError(f"ckpt {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


def tree(path: Path) -> dict[str, str]:
    """Every file under path (or path itself) -> its sha256."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {p.relative_to(path).as_posix() if p != path else "": hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


@pytest.fixture(scope="module")
def sources(llama_run, tmp_path_factory) -> dict[str, Path]:
    """Our trained TP2 x PP2 checkpoint (optimizer state at iteration 8), an HF Llama in several files, an HF
    Mixtral."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("team")
    shape = {"vocab_size": 250, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
             "num_key_value_heads": 2}
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **shape)).save_pretrained(root / "hf", max_shard_size="100KB")
    MixtralForCausalLM(MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=None, **shape)).save_pretrained(root / "moe")
    return {"ours": llama_run[0], "hf": root / "hf", "moe": root / "moe"}


@pytest.fixture(scope="module")
def alone(sources, tmp_path_factory) -> dict[str, Path]:
    """Each case written by one process, as every test compares against."""
    root = tmp_path_factory.mktemp("alone")
    outs = {}
    for case, (verb, src, opts) in CASES.items():
        outs[case] = root / case
        ckpt(verb, str(sources[src]), str(outs[case]), "-q", *opts)
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_team_writes_the_bytes_one_process_writes(case, nproc, sources, alone, tmp_path):
    verb, src, opts = CASES[case]
    out = tmp_path / "out"
    proc = ckpt(verb, str(sources[src]), str(out), "-q", *opts, "--nproc-per-node", str(nproc))
    assert tree(out) == tree(alone[case])
    assert proc.stdout.count("\n") == 1 and str(out) in proc.stdout  # process 0's summary, once
    assert not output.leftovers(out)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["merge-hf", "reshard-torch_dist-optimizer", "import-ours"])
def test_a_killed_process_leaves_no_output_and_a_rerun_finishes_it(case, sources, alone, tmp_path):
    """Process 1 is killed (SIGKILL) at its first fsync, after it has written a file: torchrun ends the others and
    OUT does not appear (process 0 removes the staged dir when it notices the loss in time; else the dir stays, never
    a complete-looking output, and the rerun names it); the same command again writes it."""
    verb, src, opts = CASES[case]
    out = tmp_path / "out"
    cmd = (verb, str(sources[src]), str(out), "-q", *opts, "--nproc-per-node", "3")
    proc = ckpt(*cmd, env=_hook(tmp_path, "kill"), check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == ["error: process 1 was killed by signal 9: the output was not written"], proc.stderr[-2000:]
    assert not out.exists()
    left = output.leftovers(out)
    again = ckpt(*cmd)
    assert tree(out) == tree(alone[case])
    assert ("left by an interrupted run" in again.stdout) == bool(left)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_writer_names_what_an_interrupted_run_left(case, sources, alone, tmp_path):
    """A temp output left beside OUT (a run killed before it could remove it) is named in the summary, whichever
    writer runs, and the output is still the one a clean run writes."""
    verb, src, opts = CASES[case]
    out = tmp_path / "out"
    (tmp_path / ".out.tmp-1").mkdir()
    proc = ckpt(verb, str(sources[src]), str(out), "-q", *opts)
    assert ".out.tmp-1" in proc.stdout and "left by an interrupted run" in proc.stdout, proc.stdout
    assert tree(out) == tree(alone[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", ["reshard-ours", "merge-hf", "import-torch_dist"])
def test_a_failing_process_stops_the_team_and_leaves_nothing(case, sources, tmp_path):
    """Process 1 fails with an error at its first fsync: it says why in one line, the others stop without a word
    of their own, and the staged output is removed (also where process 0 hears of it only at the very end)."""
    verb, src, opts = CASES[case]
    out = tmp_path / "out"
    proc = ckpt(verb, str(sources[src]), str(out), "-q", *opts, "--nproc-per-node", "3",
                env=_hook(tmp_path, "error"), check=False)
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert errors == ["error (process 1 of 3): injected failure"], proc.stderr[-2000:]
    assert not out.exists() and not output.leftovers(out)


def _hook(tmp_path: Path, what: str) -> dict:
    """A sitecustomize that makes process 1 of a team die (kill) or fail (error) at its first fsync."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(f'''
import os
if os.environ.get("CKPT_TEAM") == "1" and os.environ.get("RANK") == "1":
    def fsync(fd):
        if {what!r} == "kill":
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        from ckpt_tools.errors import CkptError
        raise CkptError("injected failure")
    os.fsync = fsync
''')
    return {"PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
def test_a_team_reshards_through_the_torch_reader_as_one_process(sources, tmp_path):
    """Model and optimizer state into torch_dist through the torch reader (the path of a Megatron-LM source's
    optimizer state), by 3 processes under torchrun and by one: the same files."""
    from ckpt_tools.verbs.reshard import reshard
    reshard(sources["ours"], tmp_path / "alone", 1, 2, quiet=True, form="torch_dist", copy_bytes=False)
    env = {**os.environ, "CKPT_TEAM": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "ckpt_tools.team", "--nproc-per-node", "3",
                           f"--master-port={free_port()}", str(ROOT / "tests" / "team_reshard.py"),
                           str(sources["ours"]), str(tmp_path / "team"), "1", "2", "torch_dist"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree(tmp_path / "team") == tree(tmp_path / "alone")
    assert any(p.name.startswith("iter_") for p in (tmp_path / "team").iterdir())  # with its optimizer state


@pytest.mark.slow
def test_a_team_of_two_nodes_writes_the_bytes_one_process_writes(sources, alone, tmp_path):
    """Across nodes each node's launcher starts its processes under torchrun, and they meet over gloo: two nodes of
    one process each, here on one machine over 127.0.0.1 (a shared file system, as such nodes have), write the
    bytes one process writes."""
    verb, src, opts = CASES["merge-hf"]
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ckpt_tools.cli", verb, str(sources[src]), str(out), "-q", *opts, "--nnodes", "2",
           "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    nodes = [subprocess.Popen([*cmd, "--node-rank", str(r)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    said = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], said
    assert tree(out) == tree(alone["merge-hf"])
    assert str(out) in said[0][0] and not said[1][0]  # node 0's process 0 says the summary


def test_a_multi_node_team_needs_the_rendezvous_port(sources, tmp_path):
    proc = ckpt("merge", str(sources["hf"]), str(tmp_path / "out"), "--nnodes", "2", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: --nnodes > 1 needs --master-addr and --master-port: the address and a free port of node 0, the same "
        "on every node"]


def test_the_split_is_contiguous_and_balances_bytes_as_well_as_any_contiguous_split():
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice([0, 1, 5, 100, 1000, rng.randrange(10**6)]) for _ in range(rng.randrange(0, 9))]
        parts = rng.randrange(1, 5)
        owners = split(sizes, parts)
        assert owners == sorted(owners) and all(0 <= o < parts for o in owners) and len(owners) == len(sizes)
        weights = [max(s, 1) for s in sizes]

        def largest(assign):
            return max((sum(w for w, o in zip(weights, assign) if o == p) for p in range(parts)), default=0)
        best = min((largest([sum(i >= c for c in cuts) for i in range(len(sizes))])
                    for cuts in itertools.combinations_with_replacement(range(len(sizes) + 1), parts - 1)),
                   default=0)
        assert largest(owners) == best, (sizes, parts, owners)


def test_the_processes_run_the_command_without_the_launcher_options():
    argv = ["--debug", "reshard", "a", "b", "--tp", "2", "--nproc-per-node", "3", "--master-port=29500",
            "--nnodes=1", "--node-rank", "0", "--master-addr", "10.0.0.1", "-q"]
    assert worker_argv(argv) == ["--debug", "reshard", "a", "b", "--tp", "2", "-q"]


def test_inspect_plan_splits_the_files_by_bytes_and_times_the_slowest_process(sources):
    """`ckpt inspect --plan N --bandwidth B`: every file once, in contiguous runs, the time of the slowest run at B/N."""
    import re

    from ckpt_tools.verbs.inspect import team_plan
    text = team_plan(sources["ours"], 3, bandwidth=30.0)
    rows = re.findall(r"process (\d): (\d+) files, .*?, ~([\d.]+) s", text)
    assert [int(p) for p, _, _ in rows] == [0, 1, 2]
    ckpt_dir = next(p for p in sources["ours"].iterdir() if p.name.startswith("checkpoint-8"))
    files = sorted(p for p in ckpt_dir.rglob("*") if p.is_file())
    assert sum(int(n) for _, n, _ in rows) == len(files)
    owners = split([p.stat().st_size for p in files], 3)
    slowest = max(sum(p.stat().st_size for p, o in zip(files, owners) if o == k) for k in range(3)) / (30e6 / 3)
    assert f"~{slowest:,.1f} s for the slowest process" in text


@pytest.mark.slow
def test_a_team_verifies_tier_1_as_one_process_and_finds_a_changed_tensor(alone, sources, tmp_path):
    """`ckpt verify SRC OTHER --nproc-per-node 3`: file hashes and tensor comparisons shared out, the same tier-1
    findings as one process; a tensor changed in OTHER among the last process's share is named; tiers 2-3 run."""
    import shutil

    from safetensors.torch import load_file, save_file
    other = alone["merge-hf"]
    one = ckpt("verify", str(sources["ours"]), str(other))
    team = ckpt("verify", str(sources["ours"]), str(other), "--nproc-per-node", "3")
    assert team.stdout == one.stdout and "verify passed" in team.stdout
    bad = shutil.copytree(other, tmp_path / "bad")
    last = sorted(bad.glob("model-*.safetensors"))[-1]
    tensors = load_file(last)
    name = sorted(tensors)[-1]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1
    save_file(tensors, last, metadata={"format": "pt"})
    proc = ckpt("verify", str(sources["ours"]), str(bad), "--nproc-per-node", "3", check=False)
    assert proc.returncode == 1
    assert f"-> {name}: 1 element(s) differ" in proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]  # one line, once (process 0's)
    assert len(errors) == 1 and errors[0].startswith("error: verify failed: tier 1 weights: tensor "), proc.stderr
    assert f"-> {name}: 1 element(s) differ" in errors[0], errors[0]


def test_free_ports_come_from_the_jobs_own_range(monkeypatch):
    """CKPT_PORT_RANGE (each pytest-xdist worker sets its own): every rendezvous port is drawn from it, never a port
    bound now; a malformed or exhausted range is a one-line error naming the variable."""
    import socket

    from ckpt_tools.errors import CkptError
    monkeypatch.setenv("CKPT_PORT_RANGE", "28000-28003")
    with socket.socket() as held:
        held.bind(("", 28001))
        ports = {free_port() for _ in range(40)}
    assert ports <= {28000, 28002, 28003} and len(ports) > 1
    monkeypatch.setenv("CKPT_PORT_RANGE", "28000-27000")
    with pytest.raises(CkptError, match="CKPT_PORT_RANGE='28000-27000' is not a port range"):
        free_port()
    monkeypatch.setenv("CKPT_PORT_RANGE", "28001-28001")
    with socket.socket() as held:
        held.bind(("", 28001))
        with pytest.raises(CkptError, match="no free port in CKPT_PORT_RANGE=28001-28001"):
            free_port()
    monkeypatch.delenv("CKPT_PORT_RANGE")  # a user's run: a port the kernel hands out, free to bind
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


def test_a_team_on_one_node_starts_without_torch_and_writes_what_one_process_writes(tmp_path):
    """On one node the launcher starts the processes itself and they meet through process 0 (team._Link): an import
    into torch_dist by copying bytes runs in a team of 2 with torch imported by no process (every process's import
    log; torch is what the launcher and the rendezvous cost before, 2.7 s of start-up), and writes the files one
    process writes."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, vocab_size=250, hidden_size=64, intermediate_size=96,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path / "hf")
    opts = ("--tp", "2", "--pp", "2", "--format", "torch_dist", "-q")
    ckpt("import", str(tmp_path / "hf"), str(tmp_path / "alone"), *opts)
    proc = ckpt("import", str(tmp_path / "hf"), str(tmp_path / "team"), *opts, "--nproc-per-node", "2",
                env={"PYTHONPROFILEIMPORTTIME": "1"})
    modules = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert modules.count("ckpt_tools.verbs.dist_copy") == 2  # each process of the team (the launcher only starts them)
    assert not [m for m in modules if m == "torch" or m.startswith("torch.")]
    assert tree(tmp_path / "team") == tree(tmp_path / "alone")
