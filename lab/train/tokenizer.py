"""The study's tokenizer: byte-level BPE (the `tokenizers` library), trained once on a sample of the
corpus' training split and committed as lab/train/tokenizer.json, so every run uses the same one.

The sample is every training file whose SHA-256 falls below a threshold chosen to give about
--sample-mb of text (a fixed pseudo-random sample: the same manifest gives the same sample).
Held-out files are never read.  Id 0 is the document separator `<|endoftext|>`.

    python3 lab/train/tokenizer.py --data /tmp/mala-train/data --out lab/train/tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import code_corpus as corpus  # noqa: E402

VOCAB_SIZE = 32768


def sample_rows(rows, sample_bytes: int):
    train = [r for r in rows if r[0] == "train"]
    total = sum(r[2] for r in train)
    if total <= sample_bytes:
        return train
    frac = sample_bytes / total
    cut = int(frac * 16 ** 8)
    return [r for r in train if int(r[1][:8], 16) < cut]


def train_tokenizer(texts, vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[corpus.SEPARATOR],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="the folder with manifest.tsv.gz / manifest.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=VOCAB_SIZE)
    ap.add_argument("--sample-mb", type=float, default=160.0)
    a = ap.parse_args(argv)
    import tokenizers

    rows, header = corpus.read_manifest(a.data)
    sample = sample_rows(rows, int(a.sample_mb * 1e6))
    texts = corpus.load_split([("train",) + r[1:] for r in sample], header, "train")
    tok = train_tokenizer(texts, a.vocab)
    tok.save(a.out)
    info = {"vocab_size": tok.get_vocab_size(), "sample_files": len(texts),
            "sample_bytes": sum(r[2] for r in sample), "tokenizers_version": tokenizers.__version__}
    with open(os.path.splitext(a.out)[0] + ".info.json", "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info))


if __name__ == "__main__":
    sys.exit(main())
