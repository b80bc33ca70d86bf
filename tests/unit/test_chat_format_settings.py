"""``--chat-template`` and ``--tool-call-parser`` at start-up: a template is read as vLLM reads it (a file,
or the template itself when it holds ``{``, ``}`` or a newline) and must parse as Jinja; a parser must be
a known one. Anything else exits 2 with the reason before anything starts."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.launch.cli import main
from app.settings import Settings
from workers.families import STRUCTURAL_TAG_FORMATS
from workers.families.chat_template import ChatTemplateError, load_chat_template

TEMPLATE = "{%- for message in messages -%}{{ message['content'] }}{%- endfor -%}"


def test_an_unknown_tool_call_parser_is_refused_naming_the_valid_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--tool-call-parser", "mistral"]) == 2
    err = capsys.readouterr().err
    assert "tool_call_parser" in err and "'mistral'" in err and "valid: hermes" in err, err


def test_every_known_tool_call_parser_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(Settings(tool_call_parser=name).tool_call_parser == name for name in STRUCTURAL_TAG_FORMATS)
    monkeypatch.setenv("MMSERVE_TOOL_CALL_PARSER", "hermes")
    assert Settings().tool_call_parser == "hermes"
    monkeypatch.setenv("MMSERVE_TOOL_CALL_PARSER", "llama3_json")
    with pytest.raises(ValidationError, match="unknown tool-call parser 'llama3_json'"):
        Settings()


def test_no_flags_keep_the_models_own() -> None:
    settings = Settings()
    assert settings.chat_template is None and settings.chat_template_text() is None
    assert settings.tool_call_parser is None


def test_a_template_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE + "\n\\n é")  # a backslash and non-ASCII text stay as written in a file
    settings = Settings(chat_template=str(path))
    assert settings.chat_template == str(path) and settings.chat_template_text() == path.read_text()
    monkeypatch.setenv("MMSERVE_CHAT_TEMPLATE", str(path))
    assert Settings().chat_template_text() == path.read_text()


def test_a_template_given_inline_is_the_template_with_its_escapes_decoded() -> None:
    inline = "{{ messages[0]['content'] }}\\n→ done"
    assert load_chat_template(inline) == "{{ messages[0]['content'] }}\n→ done"
    assert Settings(chat_template=inline).chat_template_text() == "{{ messages[0]['content'] }}\n→ done"


def test_transformers_generation_blocks_parse() -> None:
    text = "{%- for m in messages -%}{% generation %}{{ m['content'] }}{% endgeneration %}{%- endfor -%}"
    assert load_chat_template(text) == text


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: str(tmp / "missing.jinja"), "looks like a file path, but it cannot be read"),
        (lambda tmp: str(tmp), "looks like a file path, but it cannot be read"),  # a folder
        (lambda tmp: _write(tmp / "latin1.jinja", "{{ 'caf\xe9' }}".encode("latin-1")), "cannot be read"),
        (
            lambda tmp: _write(tmp / "bad.jinja", b"{% for m in messages %}\n{{ m }}\n"),
            "is not a Jinja template: line 2: Unexpected end of template",
        ),
        (lambda tmp: "{{ messages[0] }", "given inline) is not a Jinja template"),
    ],
    ids=["missing-file", "folder", "not-utf8", "unclosed-for", "bad-inline"],
)
def test_a_template_that_cannot_serve_stops_the_start(
    make: Callable[[Path], str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    value = make(tmp_path)
    with pytest.raises(ChatTemplateError, match=re.escape(says)):
        load_chat_template(value)
    assert main(["serve", "--chat-template", value]) == 2
    err = capsys.readouterr().err
    assert "chat_template" in err and says in err, err


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)
