"""The chat template a server is given over the checkpoint's own (``--chat-template``), read as vLLM reads
it. app/settings.py reads it when the settings are built, so a template that cannot be read or parsed
stops the start, not a request; the API process builds its ``FamilyProcessor`` with the text. Imported
only where a template is given (jinja2 stays out of the processes that render nothing).
"""

from __future__ import annotations

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

# A value that opens as no file is the template itself when it holds one of these (vLLM's rule).
_JINJA_CHARS = "{}\n"


class ChatTemplateError(ValueError):
    """``--chat-template`` names no readable file and is no template, or its template does not parse."""


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' ``{% generation %}…{% endgeneration %}`` (it marks the assistant's tokens), so a
    template that uses it parses here as it renders there."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def load_chat_template(value: str) -> str:
    """The template ``--chat-template VALUE`` gives, as vLLM reads it: the text of the file ``value``
    names; where no file opens, ``value`` itself, its backslash escapes decoded (``\\n``), when it holds
    a ``{``, ``}`` or newline. Otherwise, or when the template does not parse as Jinja (as transformers
    parses it), ChatTemplateError."""
    try:
        with open(value, encoding="utf-8") as file:
            text, source = file.read(), f"file {value!r}"
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL in the name
        if not any(char in value for char in _JINJA_CHARS):
            raise ChatTemplateError(
                f"--chat-template {value!r} looks like a file path, but it cannot be read ({exc}); "
                "give a readable Jinja file, or the template itself"
            ) from exc
        # vLLM's codecs.decode(value, "unicode_escape"), which would garble non-ASCII text: those
        # characters travel as escapes through the decoding instead
        text = value.encode("latin-1", "backslashreplace").decode("unicode_escape")
        source = "given inline"
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock]
    )
    try:
        environment.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"--chat-template ({source}) is not a Jinja template: line {exc.lineno}: {exc.message}"
        ) from exc
    return text
