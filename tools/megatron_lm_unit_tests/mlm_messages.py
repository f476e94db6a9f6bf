"""Compare one mode's test results with stock's: outcomes *and* messages (part of :mod:`run`).

A failure in stock and a different failure in the same test with the plugin installed are not
the same result. Messages are compared after :func:`normalise`, which removes only what varies
between two runs of the same code: memory addresses, data pointers and object ids, temporary
paths, ports, pids, durations, pytest's ``+ where ...`` introspection of intermediate values
(uninitialised memory prints differently every run; the failing assertion itself is kept), and
the order of items where it is a set's or a dict's: inside a set or dict
repr (``{...}``) and in pytest's ``Differing items: {k: v} != {k: v} ...`` list (it iterates
a set of keys). Everything else must be equal. (run.py also fixes ``PYTHONHASHSEED``, so hash
order rarely varies at all.)
"""

import re

#: (pattern, replacement), applied in order by :func:`normalise`
_VARYING = [
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),  # addresses: `<X object at 0x7f..>`, pointers
    (re.compile(r"\b(id|pid|tid|ident|thread|process)([=: ]+)\d+", re.IGNORECASE), r"\1\2?"),
    (re.compile(r"(/tmp|/var/tmp|/dev/shm)/[^\s'\",:;)\]}>]*"), "<tmp>"),  # temp files
    (re.compile(r"\b(pytest|tmp)[-_][\w.-]*\d[\w.-]*"), "<tmp>"),  # pytest-123, tmpab12cd
    (re.compile(r"((?:localhost|\d+\.\d+\.\d+\.\d+|\]):)\d{2,5}\b"), r"\1?"),  # host:port
    (re.compile(r"\b(port)([=: ]+)\d+", re.IGNORECASE), r"\1\2?"),
    (re.compile(r"\b\d+(\.\d+)?(e-?\d+)?\s?(s|ms|us|sec|secs|seconds)\b"), "<time>"),
    (re.compile(r"\b\d{12,}\b"), "<ptr>"),  # data_ptr() values in decimal
]
#: pytest's introspection after the failing assertion (``+ where x = f(...)``): it prints the
#: intermediate values, e.g. a ``torch.empty`` tensor's uninitialised memory, which differ
#: between two runs of the same code; the assertion itself is kept
_WHERE = re.compile(r" \+ where .*$")


def _split_top(body: str):
    """``body`` (inside one ``{...}``) split at the commas outside brackets and quotes."""
    items, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(body):
        if quote:
            if ch == quote and body[i - 1] != "\\":
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(body[start:i].strip())
            start = i + 1
    items.append(body[start:].strip())
    return items


def _sort_braces(text: str) -> str:
    """Every balanced ``{...}`` with its top-level items sorted (inner braces first); an
    unbalanced one (a message cut short) is left as it is."""
    out, stack = [], []  # stack: index in `out` where each open brace's content starts
    for ch in text:
        if ch == "{":
            out.append(ch)
            stack.append(len(out))
        elif ch == "}" and stack:
            start = stack.pop()
            body = "".join(out[start:])
            del out[start:]
            out.append(", ".join(sorted(_split_top(body))) + "}")
        else:
            out.append(ch)
    return "".join(out)


#: pytest's assertion-rewrite list of a dict comparison's differing items (set order)
_DIFFERING = re.compile(r"(Differing items: )((?:\{[^{}]*\} != \{[^{}]*\} ?)+)")
_DIFFERING_ITEM = re.compile(r"\{[^{}]*\} != \{[^{}]*\}")


def _sort_differing(match) -> str:
    return match.group(1) + " ".join(sorted(_DIFFERING_ITEM.findall(match.group(2)))) + " "


def normalise(message: str) -> str:
    """``message`` without what legitimately varies between two runs (module docstring)."""
    for pattern, replacement in _VARYING:
        message = pattern.sub(replacement, message)
    message = _WHERE.sub("", " ".join(message.split()))
    message = _DIFFERING.sub(_sort_differing, message)
    return _sort_braces(message).strip()


def _result_key(res: dict):
    """What must be equal: the outcome and, for a failure or a skip, its normalised message."""
    if res is None:
        return ("absent", "")
    return (res["outcome"], normalise(res.get("message", ""))
            if res["outcome"] in ("failed", "skipped") else "")


def differences(stock: dict, other: dict):
    """``[(test id, stock outcome, other outcome, stock message, other message)]`` for every
    test whose outcome or normalised message differs between ``stock`` and ``other``."""
    found = []
    for test_id in sorted(set(stock) | set(other)):
        a, b = stock.get(test_id), other.get(test_id)
        if _result_key(a) != _result_key(b):
            found.append((test_id, (a or {}).get("outcome", "absent"),
                          (b or {}).get("outcome", "absent"), (a or {}).get("message", ""),
                          (b or {}).get("message", "")))
    return found


def short(message: str, limit: int = 300) -> str:
    """``message`` on one line for the table, at most ``limit`` characters, backticks removed
    (it goes inside a code span)."""
    text = " ".join(message.split()).replace("`", "'")
    return text if len(text) <= limit else text[:limit - 3] + "..."
