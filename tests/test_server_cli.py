"""`car-jax build-index` and `car-jax serve-retriever` end to end."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from car_jax.cli import main
from car_jax.tools.http_client import HttpRetriever
from car_jax.tools.index import load_retriever, read_meta

CORPUS = Path(__file__).parent / "fixtures" / "tiny_wiki.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The server's process as a terminal starts it: SIGINT unblocked and raising KeyboardInterrupt.
# Ignored and blocked signals survive exec, and after other tests the suite's process may hold
# SIGINT so (the server then never saw the SIGINT below; alone it did). Done in the child's
# first line, not in a preexec_fn: Python code between fork and exec in a multithreaded (JAX)
# process can deadlock.
AS_FROM_A_SHELL = ("import runpy, signal; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
                   "signal.signal(signal.SIGINT, signal.default_int_handler); "
                   "runpy.run_module('car_jax.cli', run_name='__main__', alter_sys=True)")


def test_build_index_commands(tmp_path, capsys):
    assert main(["build-index", "--corpus", str(CORPUS), "--out", str(tmp_path / "hnsw"),
                 "--index-type", "hnsw", "--hnsw-m", "8", "--ef-search", "40", "--batch-size", "16"]) == 0
    assert "built dense index of 50 docs" in capsys.readouterr().out
    meta = read_meta(tmp_path / "hnsw")
    assert meta["faiss"]["factory"] == "HNSW8" and meta["faiss"]["search_params"] == {"efSearch": 40}
    assert load_retriever(tmp_path / "hnsw").search(["what is the capital of japan"], 1)[0][0].id == "14"
    assert main(["build-index", "--corpus", str(CORPUS), "--out", str(tmp_path / "bm25"), "--backend", "bm25"]) == 0
    assert read_meta(tmp_path / "bm25")["bm25"]["method"] == "lucene"


def test_serve_retriever_command(tmp_path):
    assert main(["build-index", "--corpus", str(CORPUS), "--out", str(tmp_path), "--backend", "bm25"]) == 0
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", AS_FROM_A_SHELL, "serve-retriever", "--index", str(tmp_path), "--port", str(port),
         "--topk", "2", "--noise-shuffle", "1.0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        health = None
        for _ in range(240):  # the interpreter starts in a few seconds on a busy machine
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    health = json.loads(r.read())
                break
            except OSError:
                assert proc.poll() is None, proc.stdout.read().decode()
                time.sleep(0.25)
        assert health["status"] == "ok" and health["num_docs"] == 50
        assert health["noise"]["shuffle_rate"] == 1.0
        rows = HttpRetriever(f"127.0.0.1:{port}").search(["who painted the starry night"], topk=2)
        assert len(rows[0]) == 2 and "45" in [d.id for d in rows[0]]
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0].decode()
    assert proc.returncode == 0, out
    assert f"at http://127.0.0.1:{port}/retrieve" in out
    assert "faiss.loader" not in out, out  # start-up noise (`test_serve_retriever_start_quiets_library_logs`)


def test_serve_retriever_start_quiets_library_logs():
    """serve-retriever logs at INFO; faiss's loader and jax's backend probe (libtpu missing)
    log at INFO when imported: `setup_logging` keeps them at WARNING and car_jax at INFO. The
    same imports under a plain INFO setup show the noise (so the check can fail)."""
    body = ("import faiss, jax\n"
            "jax.devices()\n"
            "logging.getLogger('car_jax.tools.server').info('car_jax line kept')\n")
    setups = {"plain": "import logging\nlogging.basicConfig(level=logging.INFO, format='%(name)s: %(message)s')\n",
              "quiet": "import logging\nfrom car_jax.cli.tools import setup_logging\nsetup_logging()\n"}
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # jax probes its plugins as a user's does
    logs = {}
    for name, setup in setups.items():
        out = subprocess.run([sys.executable, "-c", setup + body], capture_output=True, text=True, timeout=300,
                             env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        logs[name] = out.stderr
    assert "faiss.loader" in logs["plain"]  # the noise this fixes
    noisy = [line for line in logs["quiet"].splitlines() if "faiss" in line or "xla_bridge" in line]
    assert noisy == [], logs["quiet"]
    assert "car_jax.tools.server: car_jax line kept" in logs["quiet"]
