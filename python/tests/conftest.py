"""Shared fixtures. Nothing here skips: a missing dependency (the package, NumPy, PyTorch,
transformers, the model, the C++ replay driver) fails the test that needs it, except for the tests
marked `gpu`, which run on the GPU machine (python/gpu/run.sh) and are deselected elsewhere."""

import os
import pathlib
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _build_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("SPECACHE_BUILD_DIR", REPO / "build"))


@pytest.fixture(scope="session")
def replay_binary() -> str:
    """The C++ agent driver (python/tests/agent_replay.cc) of the ordinary CMake build."""
    path = pathlib.Path(os.environ.get("SPECACHE_AGENT_REPLAY", _build_dir() / "python" / "specache-agent-replay"))
    if not path.is_file():
        pytest.fail(f"{path} not built: build the CMake project first (tools/setup.sh), or set SPECACHE_AGENT_REPLAY")
    return str(path)


@pytest.fixture(scope="session")
def specache_run() -> str:
    path = pathlib.Path(os.environ.get("SPECACHE_RUN_BINARY", _build_dir() / "tools" / "specache-run"))
    if not path.is_file():
        pytest.fail(f"{path} not built (tools/setup.sh builds specache-run)")
    return str(path)


@pytest.fixture(scope="session")
def model_path() -> pathlib.Path:
    """The bundled SmolLM2 GGUF (tools/fetch-model.sh puts it in models/)."""
    path = pathlib.Path(os.environ.get("SPECACHE_MODEL", REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not path.is_file():
        pytest.fail(f"model {path} missing: run tools/fetch-model.sh")
    return path


@pytest.fixture(scope="session")
def hf_model(model_path):
    """SmolLM2-135M loaded by transformers from the same GGUF file (float32, CPU) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    model = AutoModelForCausalLM.from_pretrained(model_path.parent, gguf_file=model_path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def have_tool(name: str) -> bool:
    return shutil.which(name) is not None
