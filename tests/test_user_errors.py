"""Ordinary mistakes end in one line that says what to do and exit code 2, never a traceback: each case a new
user met (a CUDA device without CUDA, a quantized source, a path that is no checkpoint or a hub id, a server
that is not there, a wrong option value, vLLM missing, a port in use)."""

import http.server
import socket
import subprocess
import sys
import threading

import pytest
import torch

from fp4moe.cli import main
from fp4moe.cli.options import EXIT_ERROR

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the message for a machine without CUDA")


def _fails(capsys, argv: list[str]) -> str:
    """Run ``fp4moe ARGV``, expecting a user's error: exit code 2 and the one line it printed (no traceback,
    nothing else on stderr)."""
    capsys.readouterr()  # what building the fixtures printed
    assert main(argv) == EXIT_ERROR
    return _error_line(capsys, argv[0])


def _error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"fp4moe {command}: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@no_cuda
@pytest.mark.parametrize("command", ["quantize", "generate", "serve", "eval"])
def test_cuda_device_without_cuda(command, checkpoints, tmp_path, capsys):
    src = str(checkpoints.bf16())
    argv = {
        "quantize": ["quantize", src, str(tmp_path / "out")],
        "generate": ["generate", src, "hi"],
        "serve": ["serve", src, "--port", str(_free_port())],
        "eval": ["eval", src, "--ref", src],
    }[command]
    line = _fails(capsys, [*argv, "--device", "cuda"])
    assert "--device cuda: no CUDA GPU here" in line and "use --device cpu" in line
    assert not (tmp_path / "out").exists()


def test_bad_device_string(checkpoints, capsys):
    line = _fails(capsys, ["generate", str(checkpoints.bf16()), "hi", "--device", "gpu0"])
    assert "use auto, cpu, cuda or cuda:N" in line


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_quantizing_a_quantized_checkpoint(fmt, checkpoints, tmp_path, capsys):
    src = checkpoints.quantized(fmt=fmt)
    line = _fails(capsys, ["quantize", str(src), str(tmp_path / "out"), "--no-progress"])
    assert f"{src} is already quantized" in line and "bf16 source checkpoint" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["serve", "generate", "inspect", "quantize"])
def test_missing_path(command, tmp_path, capsys):
    nope = str(tmp_path / "nope")
    argv = {
        "serve": ["serve", nope, "--port", str(_free_port())],
        "generate": ["generate", nope, "hi"],
        "inspect": ["inspect", nope],
        "quantize": ["quantize", nope, str(tmp_path / "out")],
    }[command]
    assert f"{nope}: no such directory" in _fails(capsys, argv)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_hub_id_given_as_a_path(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no ./Qwen folder
    argv = ["Qwen/Qwen3.6-35B-A3B"] + (["hi"] if command == "generate" else ["--port", str(_free_port())])
    line = _fails(capsys, [command, *argv])
    assert "looks like a Hugging Face id" in line
    assert "hf download Qwen/Qwen3.6-35B-A3B --local-dir DIR" in line


def test_bench_without_a_server(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}/v1"
    line = _fails(capsys, ["bench", "--base-url", url, "--no-progress", "--out", str(tmp_path)])
    assert f"no server answers at {url}" in line and "fp4moe serve" in line


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # what a server answers for /models without the /v1 prefix
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"detail": "Not Found"}')

    def log_message(self, *args):
        pass


def test_bench_without_v1_in_the_url(tmp_path, capsys):
    server = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        line = _fails(capsys, ["bench", "--base-url", url, "--no-progress", "--out", str(tmp_path)])
    finally:
        server.shutdown()
    assert "lists no model (HTTP 404)" in line and f"did you mean {url}/v1?" in line


def test_eval_dtype_names_the_choices(checkpoints, capsys):
    src = str(checkpoints.bf16())
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", src, "--ref", src, "--dtype", "fp16"])
    assert exit_info.value.code == EXIT_ERROR
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_vllm_exec_without_vllm(checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no vllm on it
    argv = ["serve", str(checkpoints.quantized()), "--engine", "vllm", "--exec", "--port", str(_free_port())]
    line = _fails(capsys, argv)
    assert "vllm is not installed here" in line and "drop --exec" in line


def test_port_in_use_is_found_before_the_model_loads(checkpoints, monkeypatch, capsys):
    import fp4moe.engine.front.process as process

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(process, "EngineProcess", load)
    monkeypatch.setattr(process, "start_engine", load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _fails(capsys, ["serve", str(checkpoints.bf16()), "--port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in line and "pick another --port" in line


def test_python_m_fp4moe():
    out = subprocess.run(
        [sys.executable, "-m", "fp4moe", "--version"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.startswith("fp4moe "), out
