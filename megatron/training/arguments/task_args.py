"""Flags of task-specific models Megatron-LM ships: the biencoder (ICT/REALM) and vision models.

Kept so that existing command lines parse; names, types and defaults follow Megatron-LM's
``megatron/training/arguments.py`` (https://github.com/NVIDIA/Megatron-LM).
"""
from __future__ import annotations


def _add_biencoder_args(parser):
    group = parser.add_argument_group(title="biencoder")

    # network size
    group.add_argument("--ict-head-size", type=int, default=None, help="Size of the ICT head's block embedding.")
    group.add_argument("--biencoder-projection-dim", type=int, default=0,
                       help="Projection dimension of the biencoder towers (0: none).")
    group.add_argument("--biencoder-shared-query-context-model", action="store_true",
                       help="Share one model between the query and context towers.")
    # checkpointing
    group.add_argument("--ict-load", type=str, default=None, help="Directory containing an ICT model checkpoint.")
    group.add_argument("--bert-load", type=str, default=None,
                       help="Directory containing a BERT checkpoint to initialise ICT/REALM from.")
    # data
    group.add_argument("--titles-data-path", type=str, default=None, help="Path to the titles dataset.")
    group.add_argument("--query-in-block-prob", type=float, default=0.1,
                       help="Probability of keeping the query in its block (ICT).")
    group.add_argument("--use-one-sent-docs", action="store_true", help="Keep one-sentence documents (ICT).")
    group.add_argument("--evidence-data-path", type=str, default=None, help="Path to the Wikipedia evidence (DPR).")
    # training
    group.add_argument("--retriever-report-topk-accuracies", nargs="+", type=int, default=[],
                       help="Which top-k retrieval accuracies to report, e.g. 1 5 20.")
    group.add_argument("--retriever-score-scaling", action="store_true",
                       help="Scale retriever scores by 1 / sqrt(hidden size).")
    # faiss index
    group.add_argument("--block-data-path", type=str, default=None, help="Where to save/load the block data.")
    group.add_argument("--embedding-path", type=str, default=None, help="Where to save/load the evidence embeddings.")
    # indexer
    group.add_argument("--indexer-batch-size", type=int, default=128, help="Batch size of the indexing job.")
    group.add_argument("--indexer-log-interval", type=int, default=1000,
                       help="Log progress of the indexing job every this many batches.")
    return parser


def _add_vision_args(parser):
    group = parser.add_argument_group(title="vision")

    # general vision
    group.add_argument("--num-classes", type=int, default=1000, help="Number of image classes.")
    group.add_argument("--img-h", type=int, default=224, help="Image height.")
    group.add_argument("--img-w", type=int, default=224, help="Image width.")
    group.add_argument("--num-channels", type=int, default=3, help="Number of image channels.")
    group.add_argument("--patch-dim", type=int, default=16, help="Patch size.")
    group.add_argument("--classes-fraction", type=float, default=1.0, help="Fraction of classes used for training.")
    group.add_argument("--data-per-class-fraction", type=float, default=1.0,
                       help="Fraction of each class's data used for training.")
    group.add_argument("--no-data-sharding", action="store_false", dest="data_sharding",
                       help="Do not shard the data across data-parallel ranks.")
    group.add_argument("--head-lr-mult", type=float, default=1.0, help="Learning rate multiplier of the head.")
    # pretraining
    group.add_argument("--vision-pretraining", action="store_true", help="Pretrain a vision model.")
    group.add_argument("--vision-pretraining-type", type=str, default="classify",
                       choices=["classify", "inpaint", "dino"], help="Vision pretraining objective.")
    group.add_argument("--vision-backbone-type", type=str, default="vit", choices=["vit", "mit", "swin"],
                       help="Vision backbone.")
    group.add_argument("--swin-backbone-type", type=str, default="tiny", choices=["tiny", "base", "h3"],
                       help="Swin backbone size.")
    # inpainting
    group.add_argument("--mask-type", type=str, default="random", choices=["random", "row"],
                       help="Inpainting mask type.")
    group.add_argument("--mask-factor", type=float, default=1.0, help="Inpainting mask size scale.")
    # dino
    group.add_argument("--iter-per-epoch", type=int, default=1250, help="Iterations per epoch.")
    group.add_argument("--dino-local-img-size", type=int, default=96, help="DINO local crop size.")
    group.add_argument("--dino-local-crops-number", type=int, default=10, help="Number of DINO local crops.")
    group.add_argument("--dino-head-hidden-size", type=int, default=2048, help="Hidden size of the DINO head.")
    group.add_argument("--dino-bottleneck-size", type=int, default=256, help="Bottleneck size of the DINO head.")
    group.add_argument("--dino-freeze-last-layer", type=float, default=1,
                       help="Epochs during which the DINO head's last layer stays frozen.")
    group.add_argument("--dino-norm-last-layer", action="store_true", help="Weight-normalise the DINO last layer.")
    group.add_argument("--dino-warmup-teacher-temp", type=float, default=0.04, help="Initial DINO teacher temperature.")
    group.add_argument("--dino-teacher-temp", type=float, default=0.07, help="Final DINO teacher temperature.")
    group.add_argument("--dino-warmup-teacher-temp-epochs", type=int, default=30,
                       help="Epochs of DINO teacher temperature warmup.")
    return parser
