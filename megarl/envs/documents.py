"""A small local document set, written on this machine, and the search index the `retrieval` tool uses.

    python -m megarl.envs.documents --out DIR [--seed 0] [--cities 200]

writes DIR/documents.jsonl, one document a line {"id", "title", "text"}, and question sets DIR/train.jsonl and
DIR/heldout.jsonl {"prompt", "answer"} about them. The documents describe invented cities (name, river,
founding year, population), so no model knows the answers beforehand: a policy can only answer by searching.
Questions about a city are all in one split, so held-out questions are about cities never asked about in
training.

The index ranks documents by TF-IDF over lower-cased words: the sum over query words of the word's count in
the document times log(N / documents containing it). Ties keep the documents' file order.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

WORD = re.compile(r"[a-z0-9]+")
SYLLABLES = ["ka", "lo", "ven", "mar", "os", "ti", "ran", "bel", "du", "sor", "quel", "ni", "path", "ur", "zel"]
RIVERS = ["Osk", "Tamber", "Veil", "Rusk", "Ondra", "Callow", "Isen", "Marl"]


@dataclass(frozen=True)
class Document:
    id: str
    title: str
    text: str


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


class DocumentIndex:
    """TF-IDF search over documents held in memory (see the module docstring for the score)."""

    def __init__(self, documents: list[Document]):
        if not documents:
            raise ValueError("a document index needs at least one document")
        self.documents = documents
        self.counts = [Counter(words(f"{d.title} {d.text}")) for d in documents]
        frequency = Counter(w for c in self.counts for w in c)
        self.idf = {w: math.log(len(documents) / n) for w, n in frequency.items()}

    @classmethod
    def load(cls, path: str | Path) -> DocumentIndex:
        """Documents from a JSONL file of {"id", "title", "text"}; ValueError naming file and line."""
        documents = []
        for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                documents.append(Document(str(row["id"]), str(row["title"]), str(row["text"])))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{line_no}: expected a JSON object with id, title and text ({e})") from None
        return cls(documents)

    def search(self, query: str, *, top_k: int) -> list[Document]:
        terms = set(words(query))
        scores = [sum(c[w] * self.idf.get(w, 0.0) for w in terms) for c in self.counts]
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep file order
        return [self.documents[i] for i in ranked[:top_k] if scores[i] > 0]


def city_documents(rng: random.Random, n: int) -> list[tuple[Document, dict]]:
    """`n` invented cities: (document, facts) with distinct names."""
    names: set[str] = set()
    while len(names) < n:
        names.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize())
    out = []
    for i, name in enumerate(sorted(names)):
        facts = {"river": rng.choice(RIVERS), "founded": rng.randint(900, 1899),
                 "population": rng.randint(2000, 999999)}
        text = (f"{name} is a city on the river {facts['river']}. It was founded in {facts['founded']} "
                f"and has a population of {facts['population']}.")
        out.append((Document(f"city-{i}", name, text), facts))
    return out


QUESTIONS = {"river": "On which river lies {name}?", "founded": "In which year was {name} founded?",
             "population": "What is the population of {name}?"}


def write_document_set(out_dir: str | Path, *, seed: int = 0, cities: int = 200,
                       heldout_frac: float = 0.2) -> Path:
    """Write documents.jsonl, train.jsonl and heldout.jsonl under `out_dir`; returns the documents' path.
    Same arguments, same bytes."""
    rng = random.Random(seed)
    docs = city_documents(rng, cities)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "documents.jsonl").write_text("".join(json.dumps(vars(d)) + "\n" for d, _ in docs))
    order = list(range(len(docs)))
    rng.shuffle(order)
    n_heldout = round(heldout_frac * len(docs))
    for split, picked in (("heldout", order[:n_heldout]), ("train", order[n_heldout:])):
        rows = [{"prompt": QUESTIONS[key].format(name=docs[i][0].title), "answer": str(docs[i][1][key])}
                for i in picked for key in QUESTIONS]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out / "documents.jsonl"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for documents.jsonl, train.jsonl, heldout.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cities", type=int, default=200, help="documents to write")
    args = parser.parse_args(argv)
    print(f"wrote {write_document_set(args.out, seed=args.seed, cities=args.cities)}")


if __name__ == "__main__":
    main()
