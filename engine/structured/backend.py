"""xgrammar behind the grammar compiler: the model's vocabulary as xgrammar sees it, each constraint kind
as one xgrammar compile, and matchers. Imported on first use, in a compile thread: xgrammar (and the
tokenizer's transformers) load only in an engine that gets a constraint.
"""

from __future__ import annotations

import json
import re
from typing import Any

from engine.structured.formats import strict_formats
from engine.structured.grammar import RequestGrammar
from engine.structured.patterns import compile_exact, exact_ebnf, stand_ins
from wire.protocol import Constraint, ConstraintKind

# Between two JSON elements at most this many whitespace characters (unless any_whitespace is off: then
# only the separators ", " and ": "). Enough for pretty-printed JSON (a newline and 4-space indents three
# levels deep), and a model cannot fill its answer with whitespace (docs/api.md, "Structured outputs").
JSON_MAX_WHITESPACE = 16
# A tool call's arguments are written on one line: one whitespace character at most between elements
# (``{"city": "Paris", "days": 3}``), so a call cannot run away in whitespace either.
TOOL_CALL_MAX_WHITESPACE = 1
CALL_SEPARATOR = "\n"  # between two calls of a parallel answer (the Hermes format: Qwen's templates)
# json_object: any object, with any properties (strict mode would allow only "{}")
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's messages start with "[hh:mm:ss] /path/file.cc:123: "; the rest is for the user
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class CompileError(Exception):
    """The constraint cannot be compiled: ``code`` and ``http_status`` as the request's error says."""

    def __init__(self, message: str, code: str = "invalid_constraint", http_status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.http_status = http_status


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices`` (each a literal, escaped for xgrammar)."""
    return "root ::= " + " | ".join(_literal(choice) for choice in choices)


def _literal(text: str) -> str:
    escaped = "".join(ch if ch.isalnum() or ch in " _-.,:;!?/" else f"\\U{ord(ch):08x}" for ch in text)
    return f'"{escaped}"'


class XGrammarBackend:
    """One model vocabulary (the tokenizer in ``model_dir``, padded to the LM's ``vocab_size``)."""

    def __init__(self, model_dir: str, vocab_size: int) -> None:
        try:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            size = vocab_size or len(tokenizer)
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size)
        except Exception as exc:  # the engine was started without the model folder, or a bad one
            message = f"structured outputs are unavailable: the engine cannot load the tokenizer ({exc})"
            raise CompileError(message, "structured_outputs_unavailable", 503) from exc
        self._xgr = xgr
        self.vocab_size = size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (xgrammar releases the GIL while it works). Raises ``CompileError``."""
        compiler = self._compiler
        any_whitespace = constraint.any_whitespace
        max_whitespace = JSON_MAX_WHITESPACE if any_whitespace else None
        try:
            match constraint.kind:
                case ConstraintKind.JSON_SCHEMA:
                    patterns: dict[str, str] = {}
                    grammar = self._schema_grammar(json.loads(constraint.spec), any_whitespace, patterns)
                    return compile_exact(self._xgr, compiler, grammar, patterns)
                case ConstraintKind.JSON_OBJECT:
                    return compiler.compile_json_schema(
                        JSON_OBJECT_SCHEMA,
                        strict_mode=False,
                        any_whitespace=any_whitespace,
                        max_whitespace_cnt=max_whitespace,
                    )
                case ConstraintKind.REGEX:
                    return compiler.compile_regex(constraint.spec)
                case ConstraintKind.CHOICE:
                    return compiler.compile_grammar(choice_grammar(json.loads(constraint.spec)))
                case ConstraintKind.GRAMMAR:
                    return exact_ebnf(self._xgr, compiler, constraint.spec)
                case ConstraintKind.TOOL_CALLS:
                    patterns = {}
                    tag = self.tool_calls_tag(constraint.spec, patterns)
                    grammar = self._xgr.Grammar.from_structural_tag(tag)
                    return compile_exact(self._xgr, compiler, grammar, patterns)
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CompileError(_LOCATION.sub("", str(exc)).strip()) from exc
        raise CompileError(f"unknown constraint kind {constraint.kind!r}")

    def tool_calls_tag(self, spec: str, patterns: dict[str, str]) -> Any:
        """A ``TOOL_CALLS`` constraint's structural tag: xgrammar's own for the model's call syntax (free
        text, then calls under ``auto``; calls only under ``required``; the one named call), the arguments
        by each tool's schema, on one line; their patterns as stand-ins, added to ``patterns``."""
        fields = json.loads(spec)
        for tool in fields["tools"]:
            stand_ins(strict_formats(tool["function"]["parameters"]), patterns)
        answer = fields.get("answer")  # (under ``auto``: that JSON alone, or calls alone)
        tool_choice: Any = "required" if answer is not None else fields["tool_choice"]
        tag = self._xgr.get_model_structural_tag(
            fields["format"],
            tools=fields["tools"],
            tool_choice=tool_choice,
            reasoning="disabled",
            max_whitespace_cnt=TOOL_CALL_MAX_WHITESPACE,
            parallel_tool_calls=fields["parallel_tool_calls"],
        )
        tag = self._calls_only(tag) if tool_choice == "required" else tag
        return tag if answer is None else self._answer_or_calls(answer, tag, patterns)

    def _schema_grammar(
        self, schema: Any, any_whitespace: bool, patterns: dict[str, str], strict: bool = True
    ) -> Any:
        """A schema's grammar, its formats strict and its patterns as stand-ins (added to
        ``patterns``: ``compile_exact`` reads them)."""
        stand_ins(strict_formats(schema), patterns)
        return self._xgr.Grammar.from_json_schema(
            json.dumps(schema, ensure_ascii=False, separators=(",", ":")),
            any_whitespace=any_whitespace,
            max_whitespace_cnt=JSON_MAX_WHITESPACE if any_whitespace else None,
            strict_mode=strict,
        )

    def _answer_or_calls(self, answer: dict[str, Any], calls: Any, patterns: dict[str, str]) -> Any:
        """The output format's JSON (its grammar as a ``JSON_SCHEMA`` constraint's, as text: xgrammar's
        format for a schema in a tag cannot be compact) or the calls of ``calls``."""
        grammar = self._schema_grammar(answer["schema"], answer["any_whitespace"], patterns, answer["strict"])
        st = self._xgr.structural_tag
        either = st.OrFormat(elements=[st.GrammarFormat(grammar=str(grammar)), calls.format])
        return self._xgr.StructuralTag(format=either)

    def _calls_only(self, tag: Any) -> Any:
        """``required`` with parallel calls: xgrammar's tag lets free text follow the first call (its
        triggered tags, at least one); here only more calls may, each after a newline (as the Hermes
        template writes them), then the answer ends."""
        found = tag.format
        if not isinstance(found, self._xgr.structural_tag.TriggeredTagsFormat) or found.stop_after_first:
            return tag
        calls = self._xgr.structural_tag.TagsWithSeparatorFormat(
            tags=found.tags, separator=CALL_SEPARATOR, at_least_one=True
        )
        return self._xgr.StructuralTag(format=calls)

    def matcher(self, compiled: Any, stop_token_ids: list[int]) -> RequestGrammar:
        """A fresh matcher for one request; ``stop_token_ids`` end its grammar (the model's EOS)."""
        matcher = self._xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)
        return RequestGrammar(matcher, self.vocab_size, stop_token_ids)
