"""What of a local tree stays behind: SkyPilot's rsync filters, read as rsync reads them.

SkyPilot sends a workdir or file-mount folder with ``rsync --filter='dir-merge,- .skyignore'``
when the tree's top has a ``.skyignore``, else ``--filter='dir-merge,- .gitignore'
--exclude-from=.git/info/exclude``. So: every folder's ``.skyignore`` (or ``.gitignore``) adds
exclude patterns for what is below it, and ``.git/info/exclude`` counts everywhere.

rsync's pattern rules (``man rsync``, "PATTERN MATCHING RULES"), which differ from git's
(SkyPilot issue #3298):

- a pattern starting with ``/`` is anchored at its file's folder; any other is matched against
  the end of the path from the tree's top, at a ``/`` boundary: ``data/*`` leaves out
  ``src/data/a.py``, ``/data/*`` only ``data/a.py``; one without a ``/`` (but a trailing one)
  or ``**``, against the last component only;
- ``x/`` names directories only (a link to one is not one), ``x/***`` is the directory ``x``
  and everything in it;
- ``*`` and ``?`` stay within a component, ``**`` does not, a leading ``**/`` may be no
  folder at all (``a/**/b`` needs one); ``[...]`` with ``!``/``^`` and POSIX classes
  (``[[:digit:]]``); an unclosed ``[`` matches nothing; ``\\`` escapes the next character
  in a pattern that has a wildcard;
- lines are taken as written, spaces included (``foo `` is not ``foo``); an empty line, or
  one starting with ``#`` or ``;``, is skipped, and so is a git negation (``!x``: for rsync's
  ``- `` merge files a name, for ``--exclude-from`` a list reset), which matches nothing
  anyone has; in ``--exclude-from``, ``- x`` and ``+ x`` are an exclude and an include.

A left-out directory is not entered. The first rule that matches decides, the merge files'
(excludes all) before ``.git/info/exclude``'s.
"""

from __future__ import annotations

import logging
import os
import re
import string
from dataclasses import dataclass

log = logging.getLogger(__name__)

SKYIGNORE = ".skyignore"
GITIGNORE = ".gitignore"
_NOTHING = re.compile(r"(?!)")
_POSIX = {"alpha": "a-zA-Z", "digit": "0-9", "alnum": "a-zA-Z0-9", "upper": "A-Z",
          "lower": "a-z", "space": r"\s", "blank": r" \t", "xdigit": "0-9A-Fa-f",
          "punct": re.escape(string.punctuation), "cntrl": r"\x00-\x1f\x7f",
          "print": r"\x20-\x7e", "graph": r"\x21-\x7e"}


@dataclass(frozen=True)
class Rule:
    """One pattern of the file in folder ``base`` (tree-relative, "" = the top)."""

    base: str
    regex: re.Pattern[str]
    anchored: bool  # from ``base``, the whole path
    whole_path: bool  # a "/" inside or "**": the end of the path from the top
    dir_only: bool
    include: bool = False  # ``+ x`` of --exclude-from

    def matches(self, rel: str, is_dir: bool) -> bool:
        """Does the rule name the entry at tree-relative ``rel``?"""
        if self.dir_only and not is_dir:
            return False
        if self.base and not rel.startswith(self.base + "/"):
            return False
        if self.anchored:
            return bool(self.regex.fullmatch(rel[len(self.base) + 1:] if self.base else rel))
        if not self.whole_path:
            return bool(self.regex.fullmatch(rel.rsplit("/", 1)[-1]))
        parts = rel.split("/")
        return any(self.regex.fullmatch("/".join(parts[i:])) for i in range(len(parts)))


def _class(glob: str, i: int) -> tuple[str, int] | None:
    """The regex of the ``[...]`` at ``glob[i]`` and the index after it; None: unclosed."""
    j, body = i + 1, []
    if j < len(glob) and glob[j] in "!^":
        body.append("^")
        j += 1
    first = True
    while j < len(glob):
        c = glob[j]
        if c == "]" and not first:
            return "[" + "".join(body) + "]", j + 1
        if glob.startswith("[:", j) and (end := glob.find(":]", j + 2)) != -1:
            body.append(_POSIX.get(glob[j + 2:end], ""))
            j = end + 2
        else:
            body.append("\\" + c if c in "\\[]^-" and not (c == "-" and body) else c)
            j += 1
        first = False
    return None


def _regex(glob: str) -> re.Pattern[str]:
    """rsync's wildcards as a regex (fully matched)."""
    escapes = any(c in glob for c in "*?[")
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if c == "\\" and escapes and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
        elif glob.startswith("**", i):
            j = i
            while j < len(glob) and glob[j] == "*":
                j += 1
            # "**/" at the start: any folders, or none (inside, "/**/" needs one)
            if i == 0 and j < len(glob) and glob[j] == "/":
                out.append("(?:.*/)?")
                j += 1
            else:
                out.append(".*")
            i = j
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            got = _class(glob, i)
            if got is None:
                return _NOTHING
            out.append(got[0])
            i = got[1]
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out), re.S)


def parse_rules(text: str, base: str = "", prefixes: bool = False) -> list[Rule]:
    """The rules of one file in folder ``base``; ``prefixes``: ``--exclude-from``'s ``- ``
    and ``+ `` (a merge file's ``- `` modifier makes every line an exclude, as written)."""
    rules = []
    for line in text.split("\n"):
        pattern = line.rstrip("\r")
        if not pattern or pattern.startswith(("#", ";", "!")):
            continue
        include = False
        if prefixes and pattern[:2] in ("- ", "+ "):
            include, pattern = pattern[0] == "+", pattern[2:]
        dir_only = pattern.endswith("/")
        pattern = pattern.rstrip("/")
        anchored = pattern.startswith("/")
        pattern = pattern.lstrip("/")
        if not pattern:
            continue
        whole = "/" in pattern or "**" in pattern
        if pattern.endswith("/***"):  # the folder (a folder only), and all in it
            rules.append(Rule(base, _regex(pattern[:-4]), anchored, "/" in pattern[:-4]
                              or "**" in pattern[:-4], True, include))
            pattern, whole = pattern[:-4] + "/**", True
        rules.append(Rule(base, _regex(pattern), anchored, whole, dir_only, include))
    return rules


def _read(path: str) -> str:
    if not os.path.lexists(path):
        return ""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as fh:
            return fh.read()
    except OSError as err:  # what it lists would travel: say so
        log.warning("Cannot read %s (%s): what it lists is not left out", path, err)
        return ""


def ignore_file(root: str) -> str:
    """The name of the ignore files that count in the tree ``root`` (SkyPilot's choice)."""
    return SKYIGNORE if os.path.isfile(os.path.join(root, SKYIGNORE)) else GITIGNORE


class Filter:
    """The rules of one tree, read folder by folder as :func:`workdir.walk` enters them."""

    def __init__(self, root: str):
        self.root, self.name = root, ignore_file(root)
        self.info = [] if self.name == SKYIGNORE else parse_rules(
            _read(os.path.join(root, ".git", "info", "exclude")), prefixes=True)
        self.merged: dict[str, list[Rule]] = {}

    def enter(self, rel_dir: str, parent: str | None) -> None:
        """Read folder ``rel_dir``'s ignore file (``parent``: its parent's, None at the top)."""
        inherited = self.merged.get(parent, []) if parent is not None else []
        own = parse_rules(_read(os.path.join(self.root, rel_dir, self.name)), rel_dir)
        self.merged[rel_dir] = own + inherited  # the nearer file first, as rsync's order

    def left_out(self, rel_dir: str, rel: str, is_dir: bool) -> bool:
        """Does the entry ``rel`` (in folder ``rel_dir``) stay behind?"""
        for rule in (*self.merged.get(rel_dir, []), *self.info):
            if rule.matches(rel, is_dir):
                return not rule.include
        return False
