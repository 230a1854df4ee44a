"""The embedded demo runs end to end and reports token equality with HF."""
from hetero.cli import main


def test_demo_small(capsys):
    assert main(["demo", "--context", "96", "--new-tokens", "4", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "tokens identical to HF: True" in out


def test_info(capsys):
    assert main(["info", "--workers", "1"]) == 0
    assert "CPU workers: 1" in capsys.readouterr().out
