"""A user's EBNF grammar (``structured_outputs.grammar``) with ``Regex("…")`` compiled exactly
(engine/structured/patterns.py, ``exact_ebnf``): its regexes take what Python's ``re`` fully matches,
where xgrammar's own automata take more; its classes keep their meaning through the printed text; its
comments may hold quotes and brackets; a grammar xgrammar cannot read is still its error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from engine.structured.backend import CompileError, XGrammarBackend
from engine.structured.patterns import exact_ebnf
from tests.unit.test_exact_patterns import STRINGS, random_mismatches
from wire.protocol import Constraint, ConstraintKind


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo([bytes([i]) for i in range(256)]), cache_enabled=False)


def taken(compiled: Any, texts: list[str]) -> list[bool]:
    def takes(text: str) -> bool:
        matcher = xgr.GrammarMatcher(compiled)
        return bool(matcher.accept_string(text)) and matcher.is_completed()

    return [takes(text) for text in texts]


def regex_rule(pattern: str) -> str:
    """``root ::= Regex("pattern")``, the pattern written as an EBNF string."""
    return 'root ::= Regex("' + pattern.replace("\\", "\\\\").replace('"', '\\"') + '")'


def test_random_regexes_of_a_grammar_take_what_re_fully_matches(compiler: xgr.GrammarCompiler) -> None:
    wrong, xgrammar_wrong = random_mismatches(
        2,
        lambda pattern: exact_ebnf(xgr, compiler, regex_rule(pattern)),
        lambda pattern: compiler.compile_grammar(regex_rule(pattern)),
        STRINGS,
    )
    assert not wrong, wrong[:5]
    assert xgrammar_wrong, "xgrammar's own automata are exact now: a user's grammar may go as it is"


@pytest.mark.parametrize(
    ("pattern", "forbidden", "allowed"),
    [("^[A-Z]{3}( [0-9]+)?$", "ABC12", "ABC 12"), ("(a|a{1,2})", "aaa", "aa")],
)
def test_regexes_xgrammar_relaxes_are_exact(
    compiler: xgr.GrammarCompiler, pattern: str, forbidden: str, allowed: str
) -> None:
    grammar = regex_rule(pattern)
    assert taken(exact_ebnf(xgr, compiler, grammar), [forbidden, allowed]) == [False, True]
    assert taken(compiler.compile_grammar(grammar), [forbidden, allowed]) == [True, True]


def test_classes_and_comments_keep_their_meaning(compiler: xgr.GrammarCompiler) -> None:
    """``[\\^b]`` (a caret or b) would print as ``[^b]`` (neither); ``[\\^]`` as ``[^]``."""
    grammar = (
        'root ::= Regex("(a|a{1,2})") [\\^b] [^\\^a] [\\^] tail  # a comment with " and [ in it\n'
        'tail ::= "°C" | [\\x5e\\^x-z]+  # [\\^ again\n'
    )
    good = ["abc^°C", "aa^c^°C", "a^c^^x^", "ab€^y"]
    bad = ["aaa^c^°C", "a^^^°C", "a^a^°C", "acc^°C", "abc^w"]
    compiled = exact_ebnf(xgr, compiler, grammar)
    assert taken(compiled, good) == [True] * len(good)
    assert taken(compiled, bad) == [False] * len(bad)
    assert taken(compiler.compile_grammar(grammar), ["aaa^c^°C"]) == [True]  # xgrammar's own: "aaa"


def test_a_grammar_without_a_regex_or_unreadable_is_xgrammars(tiny_model: Callable[[str], Path]) -> None:
    backend = XGrammarBackend(str(tiny_model("qwen2_5_vl")), 0)
    plain = backend.compile(Constraint(ConstraintKind.GRAMMAR, 'root ::= "yes" | "no"'))
    assert taken(plain, ["yes", "no", "maybe"]) == [True, True, False]
    for broken in ['root ::= Regex("ab', 'root ::= Regex("a") [ab', 'root ::= Regex("[")']:
        with pytest.raises(CompileError) as raised:
            backend.compile(Constraint(ConstraintKind.GRAMMAR, broken))
        assert raised.value.http_status == 400, broken
    with pytest.raises(CompileError, match="range that starts at a caret"):
        backend.compile(Constraint(ConstraintKind.GRAMMAR, 'root ::= Regex("a") [\\^-z]'))
