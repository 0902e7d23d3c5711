#!/usr/bin/env python3
"""Finds loops of imports between the files of a crate's src/ (a layering check CI runs).

usage: import_cycles.py CRATE_SRC_DIR [--all-paths]

An edge A -> B means a file A names an item of file B through `use crate::...`, `use super::...`,
`use self::...` or (with --all-paths) an inline `crate::`/`super::` path; an item re-exported by
`pub use` counts as the file that defines it. Test modules (`#[cfg(test)] mod`) are not counted.
Prints each loop (a strongly connected set of files) and exits 1 when there is one."""
import os, re, sys
from collections import defaultdict

def modpath(src, f):
    rel = os.path.relpath(f, src)[:-3].split(os.sep)
    if rel[-1] in ("lib", "main", "mod"):
        rel = rel[:-1]
    return tuple(rel)

def main():
    src = sys.argv[1]
    allp = "--all-paths" in sys.argv
    files = {}
    for d, _, fs in os.walk(src):
        for f in fs:
            if f.endswith(".rs"):
                p = os.path.join(d, f)
                files[modpath(src, p)] = p
    mods = set(files)
    def resolve(segs):
        for i in range(len(segs), -1, -1):
            if tuple(segs[:i]) in mods:
                return tuple(segs[:i])
        return ()
    def expand(prefix, body):
        # expand a use tree "a::{b, c::{d}}" into paths
        out = []
        body = body.strip()
        if not body:
            return out
        # split top-level by commas
        depth = 0; cur = ""; parts = []
        for ch in body:
            if ch == "{": depth += 1
            if ch == "}": depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur); cur = ""
            else:
                cur += ch
        parts.append(cur)
        for part in parts:
            part = part.strip()
            if not part:
                continue
            m = re.match(r"^([\w:]*?)(?:::)?\{(.*)\}$", part, re.S)
            if m:
                pre = [s for s in m.group(1).split("::") if s]
                out += expand(prefix + pre, m.group(2))
            else:
                part = re.sub(r"\s+as\s+\w+$", "", part)
                out.append(prefix + [s for s in part.split("::") if s])
        return out
    # items re-exported by a module file: (module, item) -> target module
    reexp = {}
    for mp, path in files.items():
        text = re.sub(r"//[^\n]*", "", open(path).read())
        for u in re.findall(r"\bpub(?:\(crate\))?\s+use\s+([^;]+);", text):
            for p in expand([], u.strip()):
                if not p: continue
                if p[0] == "crate": segs = p[1:]
                elif p[0] == "self": segs = list(mp) + p[1:]
                elif p[0] == "super": segs = list(mp)[:-1] + p[1:]
                elif tuple(list(mp) + p[:1]) in mods: segs = list(mp) + p
                else: continue
                t = resolve(segs)
                if t in mods and t != mp:
                    reexp[(mp, p[-1])] = t
    _resolve = resolve
    def resolve(segs):
        t = _resolve(segs)
        rest = list(segs[len(t):])
        if rest and (t, rest[0]) in reexp:
            return reexp[(t, rest[0])]
        return t
    edges = defaultdict(set)
    for mp, path in files.items():
        text = open(path).read()
        # drop test modules (cfg(test) mod tests { ... }) crudely: cut from '#[cfg(test)]\nmod' to end
        m = re.search(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text)
        if m:
            text = text[:m.start()]
        text = re.sub(r"//[^\n]*", "", text)
        base = list(mp) if path.endswith(("mod.rs", "lib.rs", "main.rs")) else list(mp)
        # module's own path for super resolution: file a/b.rs => module a::b, super => a
        uses = re.findall(r"\buse\s+([^;]+);", text)
        paths = []
        for u in uses:
            u = u.strip()
            if u.startswith("crate::") or u.startswith("super::") or u.startswith("self::") or u.startswith("crate::{") or u.startswith("{"):
                for p in expand([], u):
                    paths.append(p)
        if allp:
            for p in re.findall(r"\b((?:crate|super)(?:::\w+)+)", text):
                paths.append(p.split("::"))
        for p in paths:
            if not p:
                continue
            if p[0] == "crate":
                segs = p[1:]
            elif p[0] == "super":
                cur = list(mp)
                while p and p[0] == "super":
                    cur = cur[:-1]; p = p[1:]
                segs = cur + p
            elif p[0] == "self":
                segs = list(mp) + p[1:]
            else:
                continue
            t = resolve(segs)
            if t != mp and t in mods:
                # importing a parent module (e.g. crate root) counts only if an item is named
                edges[mp].add(t)
    # Tarjan SCC
    index = {}; low = {}; st = []; on = set(); sccs = []; i = [0]
    sys.setrecursionlimit(10000)
    def strong(v):
        index[v] = low[v] = i[0]; i[0] += 1; st.append(v); on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = st.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1:
                sccs.append(comp)
    for v in list(files):
        if v not in index:
            strong(v)
    for c in sccs:
        print(f"cycle of {len(c)}: " + ", ".join(files[m][len(src)+1:] for m in sorted(c)))
    if not sccs:
        print("no cycles")
    return 1 if sccs else 0

sys.exit(main())
