"""A small corpus in Search-R1's layout, written by the tests (no downloads)."""
import json

import pytest

CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
            "Japan": "Tokyo", "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi"}


def corpus_rows(n_filler: int = 60):
    rows = [{"id": str(i), "contents": f'"{city}"\n{city} is the capital city of {country}.'}
            for i, (country, city) in enumerate(CAPITALS.items())]
    rows += [{"id": f"f{i}", "contents": f'"Filler {i}"\nA passage on river{i % 7} and '
              f'mountain{i % 11} with number {i}.'} for i in range(n_filler)]
    return rows


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in corpus_rows()))
    return path
