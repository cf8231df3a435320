"""Write the bundled demo set: a fictional encyclopedia and questions of all three families.

Everything is invented (people, towns, diseases, drugs), so no model knows the answers from pre-training:
an agent scores on the demo set only by searching. The output is deterministic; it is committed under
``stppo_envs/data/demo`` and this script is how it was made:

    python data_scripts/make_demo_data.py            # rewrites stppo_envs/data/demo/*.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "stppo_envs" / "data" / "demo"
SEED = 20251125

_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kl", "st", "th", "gr"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "n", "r", "l", "s", "th", "m", "nd", "rk", "v"]

COUNTRIES = ["Velmaria", "Ostrand", "Kessaly", "Duvenor", "Alcaris", "Threnmark", "Sorvhal", "Pelluria"]
PROFESSIONS = ["cartographer", "composer", "chemist", "architect", "astronomer", "novelist", "engineer",
               "botanist", "painter", "mathematician", "physician", "linguist"]
WORK_KINDS = {"cartographer": "atlas", "composer": "symphony", "chemist": "compound", "architect": "bridge",
              "astronomer": "comet catalogue", "novelist": "novel", "engineer": "engine", "botanist": "herbarium",
              "painter": "fresco", "mathematician": "theorem", "physician": "surgical method", "linguist": "grammar"}
LANDMARKS = ["a clock tower", "a salt market", "a glass cathedral", "a stone lighthouse", "a floating garden",
             "an old observatory", "a copper bridge", "a winter fair", "a paper mill", "a great library"]
INSTITUTION_KINDS = ["academy", "conservatory", "observatory", "institute", "college"]
ORGANS = ["liver", "kidney", "lung", "heart", "skin", "brain", "pancreas", "spleen"]
PATHOGEN_KINDS = ["bacterium", "virus", "fungus", "parasite"]
DRUG_CLASSES = ["macrolide antibiotic", "protease inhibitor", "azole antifungal", "beta blocker",
                "calcium channel blocker", "monoclonal antibody", "proton pump inhibitor", "antimalarial"]
MECHANISMS = ["blocking bacterial ribosomes", "inhibiting viral protease", "disrupting fungal membranes",
              "slowing the heart rate", "relaxing arterial muscle", "binding an inflammatory protein",
              "reducing stomach acid", "killing blood-stage parasites"]
SIDE_EFFECTS = ["nausea", "dizziness", "headache", "rash", "insomnia", "dry mouth", "fatigue", "tinnitus"]
SYMPTOMS = ["fever", "cough", "joint pain", "itching", "jaundice", "chest pain", "blurred vision", "weakness",
            "night sweats", "swelling"]


class Namer:
    """Pronounceable, unique invented names."""

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def word(self, syllables: int) -> str:
        while True:
            parts = [self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                     for _ in range(syllables)]
            word = "".join(parts).capitalize()
            if word not in self.used and 4 <= len(word) <= 12:
                self.used.add(word)
                return word


def build_world(rng: random.Random) -> dict:
    namer = Namer(rng)
    towns = [{"name": namer.word(2) + rng.choice(["dale", "ford", "holm", "wick", "mere", "by"]),
              "country": rng.choice(COUNTRIES), "river": namer.word(2), "founded": rng.randint(900, 1700),
              "landmark": rng.choice(LANDMARKS)} for _ in range(40)]
    people = []
    for _ in range(100):
        profession = rng.choice(PROFESSIONS)
        people.append({"name": f"{namer.word(2)} {namer.word(2)}", "town": rng.choice(towns),
                       "profession": profession, "born": rng.randint(1750, 1960),
                       "work": f"the {namer.word(2)} {WORK_KINDS[profession]}"})
    institutions = [{"name": f"{namer.word(2)} {kind.capitalize()}".replace(" ", " "), "kind": kind,
                     "town": rng.choice(towns), "founder": rng.choice(people), "founded": rng.randint(1800, 1990)}
                    for kind in (rng.choice(INSTITUTION_KINDS) for _ in range(20))]
    drugs = [{"name": namer.word(3).lower(), "class": rng.randrange(len(DRUG_CLASSES)),
              "side_effect": rng.choice(SIDE_EFFECTS)} for _ in range(40)]
    diseases = []
    for i in range(40):
        drug = drugs[i]
        diseases.append({"name": f"{namer.word(2)} {rng.choice(['fever', 'syndrome', 'disease', 'palsy'])}",
                         "organ": rng.choice(ORGANS), "pathogen": f"{namer.word(2)} {rng.choice(PATHOGEN_KINDS)}",
                         "drug": drug, "symptoms": rng.sample(SYMPTOMS, 2)})
    return {"towns": towns, "people": people, "institutions": institutions, "drugs": drugs, "diseases": diseases}


def passages(world: dict) -> list[tuple[str, str]]:
    out = []
    for c in COUNTRIES:
        towns = [t["name"] for t in world["towns"] if t["country"] == c][:4]
        out.append((c, f"{c} is a small inland country. Its towns include {', '.join(towns) or 'no large towns'}."))
    for t in world["towns"]:
        out.append((t["name"], f"{t['name']} is a town in {t['country']}, on the banks of the {t['river']} river. "
                               f"It was founded in {t['founded']} and is known for {t['landmark']}."))
    for p in world["people"]:
        out.append((p["name"], f"{p['name']} (born {p['born']}) is a {p['profession']} from {p['town']['name']}, "
                               f"{p['town']['country']}. {p['name'].split()[1]} is best known for {p['work']}."))
    for inst in world["institutions"]:
        out.append((inst["name"], f"The {inst['name']} is an {inst['kind']} in {inst['town']['name']}. It was "
                                  f"founded in {inst['founded']} by {inst['founder']['name']}."
                    if inst["kind"][0] in "aeiou" else
                    f"The {inst['name']} is a {inst['kind']} in {inst['town']['name']}. It was founded in "
                    f"{inst['founded']} by {inst['founder']['name']}."))
    for d in world["drugs"]:
        out.append((d["name"].capitalize(), f"{d['name'].capitalize()} is a {DRUG_CLASSES[d['class']]} that works "
                                            f"by {MECHANISMS[d['class']]}. Its most common side effect is "
                                            f"{d['side_effect']}."))
    for d in world["diseases"]:
        out.append((d["name"], f"{d['name']} is an illness of the {d['organ']} caused by the {d['pathogen']}. "
                               f"Typical symptoms are {d['symptoms'][0]} and {d['symptoms'][1]}. The first-line "
                               f"treatment is {d['drug']['name']}."))
    return out


def general_questions(world: dict, rng: random.Random) -> list[dict]:
    qs = []
    for p in world["people"]:
        qs.append((f"In which town was {p['name']} born?", [p["town"]["name"]]))
        qs.append((f"What is the profession of {p['name']}?", [p["profession"]]))
    for t in world["towns"]:
        qs.append((f"Which river flows through {t['name']}?", [t["river"], f"{t['river']} river"]))
        qs.append((f"In what year was {t['name']} founded?", [str(t["founded"])]))
    for inst in world["institutions"]:
        qs.append((f"Who founded the {inst['name']}?", [inst["founder"]["name"]]))
    rng.shuffle(qs)
    return [{"id": f"demo-general-{i}", "question": q, "golden_answers": a} for i, (q, a) in enumerate(qs)]


def multihop_questions(world: dict, rng: random.Random) -> list[dict]:
    """Two-hop bridge questions; ``supporting_titles`` names the passages of both hops, in order (as HotpotQA's
    supporting facts do), so a teacher can demonstrate the second search."""
    qs = []
    for p in world["people"]:
        hops = [p["name"], p["town"]["name"]]
        qs.append((f"On which river lies the hometown of {p['name']}?", [p["town"]["river"]], "bridge", hops))
        qs.append((f"In what year was the hometown of {p['name']} founded?", [str(p["town"]["founded"])], "bridge",
                   hops))
    for inst in world["institutions"]:
        hops = [inst["name"], inst["founder"]["name"]]
        qs.append((f"In which town was the founder of the {inst['name']} born?", [inst["founder"]["town"]["name"]],
                   "bridge", hops))
        qs.append((f"What was the profession of the person who founded the {inst['name']}?",
                   [inst["founder"]["profession"]], "bridge", hops))
    rng.shuffle(qs)
    return [{"id": f"demo-multihop-{i}", "question": q, "golden_answers": a, "type": kind, "supporting_titles": hops}
            for i, (q, a, kind, hops) in enumerate(qs)]


def medical_questions(world: dict, rng: random.Random) -> list[dict]:
    drug_names = [d["name"] for d in world["drugs"]]
    qs = []

    def mcq(question: str, correct: str, pool: list[str]) -> tuple[str, dict, str]:
        options = [correct] + rng.sample(sorted(set(pool) - {correct}), 3)
        rng.shuffle(options)
        letters = dict(zip("ABCD", options))
        return question, letters, "ABCD"[options.index(correct)]

    for d in world["diseases"]:
        qs.append(mcq(f"Which drug is the first-line treatment for {d['name']}?", d["drug"]["name"], drug_names))
        qs.append(mcq(f"Which organ does {d['name']} mainly affect?", d["organ"], ORGANS))
        qs.append(mcq(f"What is the most common side effect of the first-line treatment for {d['name']}?",
                      d["drug"]["side_effect"], SIDE_EFFECTS))
    for d in world["drugs"]:
        qs.append(mcq(f"To which drug class does {d['name']} belong?", DRUG_CLASSES[d["class"]], DRUG_CLASSES))
    rng.shuffle(qs)
    return [{"id": f"demo-medical-{i}", "question": q, "choices": c, "answer_letter": a,
             "golden_answers": [c[a], a]} for i, (q, c, a) in enumerate(qs)]


def with_splits(rows: list[dict], test_fraction: float = 0.3) -> list[dict]:
    n_test = int(len(rows) * test_fraction)
    return [{**row, "split": "test" if i < n_test else "train"} for i, row in enumerate(rows)]


def main() -> None:
    rng = random.Random(SEED)
    world = build_world(rng)
    OUT.mkdir(parents=True, exist_ok=True)
    corpus = [{"id": f"demo-{i}", "contents": f'"{title}"\n{text}'} for i, (title, text) in enumerate(passages(world))]
    files = {"corpus": corpus, "general": with_splits(general_questions(world, rng)),
             "multihop": with_splits(multihop_questions(world, rng)),
             "medical": with_splits(medical_questions(world, rng))}
    for name, rows in files.items():
        with open(OUT / f"{name}.jsonl", "w", encoding="utf-8") as handle:
            for row in rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} rows")


if __name__ == "__main__":
    main()
