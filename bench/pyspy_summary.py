"""Summarize ``py-spy record --format raw --threads`` files (what ``bench/served.py
--profile-level`` writes): per thread, samples and the functions that hold them.

    python bench/pyspy_summary.py FILE [FILE ...] [--top 12] [--self]

Inclusive (default): a function counts every sample it is on the stack of (once per sample).
``--self``: only the innermost frame. ``--under F``: only the samples with a function whose name starts with F
on the stack, counted from that frame down (e.g. one engine loop inside a whole script's run). Frames are ``function (file:line)``; the line is dropped
so one function is one row.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

FRAME = re.compile(r"^(.*) \(([^():]+)(?::\d+)?\)$")


def frame_name(frame: str) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    fn, path = m.groups()
    return f"{fn} ({Path(path).name})"


def summarize(path: Path, top: int, self_only: bool, under: str = "") -> str:
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread (")), "thread ?")
        thread = re.sub(r"^thread \(\d+\): ?", "", thread) or "main"
        proc = frames[0].split(":", 1)[0] if frames[0].startswith("process ") else ""
        key = f"{proc} {thread}".strip()
        body = [frame_name(f) for f in frames if not f.startswith(("process ", "thread ("))]
        if under:  # only samples inside ``under``, from that frame down
            at = next((i for i, f in enumerate(body) if f.startswith(under)), None)
            if at is None:
                continue
            body = body[at:]
        totals[key] += n
        names = body[-1:] if self_only else list(dict.fromkeys(body))
        for name in names:
            threads[key][name] += n
    out = [f"== {path.name}: {sum(totals.values())} samples" + (f" under {under}" if under else "")]
    for key, total in totals.most_common():
        out.append(f"-- {key}: {total} samples")
        for name, n in threads[key].most_common(top):
            out.append(f"   {n / total:6.1%}  {name}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--self", dest="self_only", action="store_true")
    ap.add_argument(
        "--under", default="", help="only samples with this function on the stack (e.g. 'LLMEngine.step')"
    )
    args = ap.parse_args()
    for f in args.files:
        print(summarize(f, args.top, args.self_only, args.under))


if __name__ == "__main__":
    main()
