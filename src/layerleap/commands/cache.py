"""``layerleap cache``: what layerleap keeps in its user cache, and deleting it (``layerleap.cache``)."""

from __future__ import annotations

import sys
import time

from . import command
from ..errors import LayerleapError


@command("cache", help="list what layerleap keeps in its cache folder (list), or delete it (clear)")
def _setup(p):
    from ..cache import CLEARABLE

    p.intermixed = True  # `cache clear --yes A B`: names after flags too (cli._Parser)
    p.add_argument("action", nargs="?", choices=("list", "clear"), default="list", help="list (the default) or clear")
    p.add_argument("entries", nargs="*", metavar="ENTRY", help="clear: the entries to delete, by name or path")
    p.add_argument("--stale", action="store_true", help="only the stale entries (list) / delete them (clear)")
    p.add_argument("--all", action="store_true", help="clear: every entry layerleap wrote")
    p.add_argument("--kind", choices=CLEARABLE, help="only the entries of this kind (with --stale: its stale ones)")
    p.add_argument("--yes", action="store_true", help="clear: delete without asking")
    p.add_argument("--dry-run", action="store_true", help="clear: print what would be deleted, delete nothing")
    p.add_argument("--json", action="store_true", help="list: print one JSON object")


def _line(e) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.modified)) if e.modified else "-"
    from ..cache import human

    text = f"{human(e.size):>9}  {when}  {e.title:<18} {e.name}"
    if e.belongs_to:
        text += f"  ({e.belongs_to})"
    if e.busy:
        text += f"  BUSY: {e.busy}"
    elif e.stale:
        text += f"  STALE: {e.stale}"
    return text


@_setup
def run(args) -> int:
    from .. import cache
    from ..files import cache_root, json_text

    root = cache_root()
    if args.action == "list":
        wrong = [f for f, v in (("ENTRY", args.entries), ("--all", args.all), ("--yes", args.yes)) if v]
        wrong += ["--dry-run"] if args.dry_run else []
        if wrong:
            verb = "go" if len(wrong) > 1 else "goes"
            raise LayerleapError(f"{', '.join(wrong)} {verb} with `layerleap cache clear`, not list")
        found = [
            e
            for e in cache.entries(root)
            if (not args.stale or e.stale is not None) and (args.kind is None or e.kind == args.kind)
        ]
        total, stale = sum(e.size for e in found), [e for e in found if e.stale is not None]
        if args.json:
            print(
                json_text(
                    {
                        "cache": str(root),
                        "entries": [e.to_dict() for e in found],
                        "total": total,
                        "stale": sum(e.size for e in stale),
                    }
                )
            )
            return 0
        if not found:
            print(f"nothing{' that matches' if args.stale or args.kind else ''} in the cache {root}")
            return 0
        for e in found:
            print(_line(e))
        print(
            f"{len(found)} entr{'ies' if len(found) != 1 else 'y'}, {cache.human(total)} in {root}"
            + (
                f"; {len(stale)} stale, {cache.human(sum(e.size for e in stale))}: "
                "`layerleap cache clear --stale` deletes them"
                if stale
                else ""
            )
        )
        return 0
    if args.json:
        raise LayerleapError("--json goes with `layerleap cache list`, not clear")
    if args.yes and args.dry_run:
        raise LayerleapError("--dry-run deletes nothing: give it without --yes")
    cache.check_choice(args.stale, args.all, args.kind, args.entries)  # before the listing's few seconds
    chosen = cache.select(cache.entries(root), args.stale, args.all, args.kind, args.entries, root)
    if not chosen:
        print(f"nothing to delete in the cache {root}")
        return 0
    size = cache.human(sum(e.size for e in chosen))
    if args.dry_run:  # what a deletion now would do: an entry another process is writing is kept
        done = cache.clear(root=root, chosen=chosen, dry_run=True)
        for e in done.deleted:
            print(_line(e))
        for e, why in done.skipped:
            print(f"would not delete: {e.name}: {why}")
        n = len(done.deleted)
        print(f"would delete {n} entr{'ies' if n != 1 else 'y'}, {cache.human(done.freed)} (--dry-run: none deleted)")
        return 0
    if not args.yes:
        for e in chosen:
            print(_line(e))
    if not args.yes:
        if not sys.stdin.isatty():
            raise LayerleapError(
                f"not deleting {len(chosen)} entr{'ies' if len(chosen) != 1 else 'y'} ({size}) without a "
                "confirmation, and stdin is no terminal to ask on: give --yes to delete them "
                "(or --dry-run to list them)"
            )
        try:
            answer = input(f"delete these {len(chosen)} entries, {size}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    done = cache.clear(root=root, chosen=chosen)
    for e, why in done.skipped:
        print(f"not deleted: {e.name}: {why}", file=sys.stderr)
    n = len(done.deleted)
    print(f"deleted {n} entr{'ies' if n != 1 else 'y'}, {cache.human(done.freed)} freed")
    return 1 if done.skipped else 0
