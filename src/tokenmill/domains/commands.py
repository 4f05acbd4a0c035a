"""`tokenmill domains train`: fit topic domains on a sample of a corpus (tokenmill.domains.train)."""

from __future__ import annotations

import argparse

from tokenmill.errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "domains", help="topic domains from the corpus itself (k-means on embeddings)"
    )
    commands = parser.add_subparsers(dest="domains_command", metavar="COMMAND", required=True)
    train = commands.add_parser(
        "train",
        help="fit K fine clusters and N domains on a sample; write the model and its card",
        description="Sample documents, embed them (fastText unsupervised vectors trained on the sample, or "
        "--embedding PATH.bin), run spherical k-means with K fine clusters, merge them into N domains "
        "(Ward, then domains below --min-share join their nearest), name each by its most distinctive terms. "
        "Writes OUTPUT/model.json (the card), OUTPUT/clusters.npz and OUTPUT/embedding.bin. The fit runs in "
        "this process on the sample (docs/curate.md, 'Topic domains').",
        epilog="example: tokenmill domains train --input data/sample --k 32 --domains 8 --min-share 0.02 "
        "--output out/demo/models/domains",
    )
    train.add_argument(
        "--input",
        required=True,
        action="append",
        metavar="DIR_OR_GLOB",
        help="a folder (every readable file below it) or a path or glob, local or gs://; repeatable",
    )
    train.add_argument("--k", type=int, required=True, help="fine clusters (k-means)")
    train.add_argument(
        "--domains", type=int, required=True, help="domains the fine clusters merge into (N <= K)"
    )
    train.add_argument("--output", required=True, help="model folder, local or gs://")
    train.add_argument("--sample", type=int, default=100_000, help="documents to fit on (default 100,000)")
    train.add_argument(
        "--min-share", type=float, default=0.01, help="a smaller domain joins its nearest (default 0.01)"
    )
    train.add_argument(
        "--embedding",
        default="fasttext",
        help="'fasttext' (default: train unsupervised vectors on the sample) or the path of a fastText .bin",
    )
    train.add_argument("--seed", type=int, default=0, help="sampling, line order and k-means++ seed")
    train.add_argument("--text-field", default="text", help="the input records' text field (default text)")
    train.add_argument("--id-field", default="id", help="the input records' id field (default id)")
    train.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> int:
    from tokenmill.corpora.records import InputFields
    from tokenmill.domains.model import DomainsError
    from tokenmill.domains.train import DomainSettings, iter_domain_lines, train_domains

    settings = DomainSettings(
        k=args.k,
        domains=args.domains,
        sample=args.sample,
        min_share=args.min_share,
        seed=args.seed,
        embedding=args.embedding,
        fields=InputFields(text=args.text_field, id=args.id_field, url=None),
    )
    try:
        card = train_domains(args.input, args.output, settings)
    except DomainsError as error:
        raise UsageError(str(error)) from None
    sample = card.sample
    print(
        f"domains: {sample.documents:,} documents sampled of {sample.documents_read:,} read "
        f"({sample.rejected:,} rejected, {sample.empty:,} empty); K={card.fine.k} fine clusters "
        f"({card.fine.iterations} iterations{'' if card.fine.converged else ', not converged'}) -> "
        f"{len(card.domains)} domains (asked {card.domains_requested}, min share {card.min_share:.0%})"
    )
    print(
        f"  cosine to own domain {card.within_domain_cosine:.3f}, between domain centres "
        f"{card.between_domain_cosine:.3f}, to own fine centroid {card.fine.cohesion:.3f}"
    )
    for line in iter_domain_lines(card):
        print(line)
    print(
        f"wrote {args.output}/model.json, clusters.npz"
        + (", embedding.bin" if card.embedding.kind == "trained" else "")
    )
    return 0
