"""A refusal said as the Explorer says it: one sentence naming the setting, why, and the values that would work.

``pv.launch``'s checks raise messages written for a call (``"microbatches=5 does not work: it does not divide the
batch of 8. Valid: 2, 4, 8."``, with a ``Fix:`` in the call's keywords); beside a control the same refusal reads
``"microbatches=5 does not divide the batch of 8 (valid: 1, 2, 4, 8)."``: the history and the call's fix stay in
the message the API raises and in the docs.

Example:
    >>> one_sentence("microbatches=5 does not work: it does not divide the batch of 8. Valid: 1, 2, 4, 8.")
    'microbatches=5 does not divide the batch of 8 (valid: 1, 2, 4, 8).'
"""

from __future__ import annotations

import re

__all__ = ["one_sentence"]


def one_sentence(message: str, setting: str | None = None, value: object = None) -> str:
    """``message``'s first sentence, its clauses joined as one sentence, with the valid values in brackets.

    Args:
        message: a refusal's text (a ``LaunchError``, ``ScheduleError`` or ``PlanError``).
        setting, value: the control at fault and its value, named first when the message does not start with it.
    """
    text = " ".join(message.split())
    valid = re.search(r"\bValid: (.+?)(?:\.(?:\s|$)|;|$)", text)
    head = re.split(r"(?<=[a-z0-9)])\. (?=[A-Z])|\bValid: |\bFix: ", text, maxsplit=1)[0].strip().rstrip(".;:")
    head = head.replace(" does not work: it does not ", " does not ")
    head = re.sub(r" does not work: (?:it )?", " cannot launch: ", head)
    head = re.sub(r"^(\S+=\S+) cannot launch: ", r"\1 cannot launch because ", head)
    head = re.sub(r" \([^()]*#\d+[^()]*\)", "", head)  # a tracker's history belongs in the docs, not beside a control
    if setting and not head.startswith(f"{setting}="):
        first = head.split(" ", 1)[0]
        lowered = f"{head[0].lower()}{head[1:]}" if first[1:].islower() else head  # not a name like ZBVZeroBubble
        head = f"{setting}={value!r} cannot launch: {lowered}" if head else f"{setting}={value!r}"
        head = head.replace(" cannot launch: ", " cannot launch because ", 1)
    if " because " in head:  # the reason, without the detail after it
        cause, _, rest = head.partition(" because ")
        head = f"{cause} because {rest.split(': ', 1)[0]}"
    if valid:
        head += f" (valid: {valid.group(1).rstrip('.').strip()})"
    return head + "."
