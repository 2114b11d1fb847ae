"""Complete prompts with a saved checkpoint and print the text:
``python tools/generate_text.py --load CKPT <model and tokenizer flags> --prompt "Once upon" [--out-seq-length 64]``
(or ``torchrun`` for TP/PP checkpoints). Sampling follows --top_k / --top_p / --temperature; --greedy for argmax."""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.inference.checkpoint_model import initialize_and_load, is_driver_rank  # noqa: E402
from megatron.inference.text_generation import generate_and_post_process  # noqa: E402
from megatron.training.errors import ConfigurationError, exit_on_configuration_error  # noqa: E402


@exit_on_configuration_error()
def main():
    model = initialize_and_load()
    from megatron.training import get_args

    args = get_args()
    if not args.prompt:
        raise ConfigurationError("tools/generate_text.py needs --prompt TEXT (repeat it for several prompts)")
    # Leave room for the prompt: --out-seq-length defaults to Megatron's 1024, more than small models have.
    tokens = min(args.out_seq_length, args.max_position_embeddings // 2)
    if tokens < args.out_seq_length and is_driver_rank():
        print(f"generating {tokens} tokens (--out-seq-length {args.out_seq_length} capped at half of "
              f"--max-position-embeddings {args.max_position_embeddings})", flush=True)
    result = generate_and_post_process(
        model, prompts=args.prompt if is_driver_rank() else None, tokens_to_generate=tokens,
        top_k_sampling=1 if args.greedy else args.top_k, top_p_sampling=0.0 if args.greedy else args.top_p,
        temperature=args.temperature, random_seed=args.seed)
    if is_driver_rank():
        for prompt, text in zip(args.prompt, result[0]):
            print("== prompt: " + repr(prompt), flush=True)
            print("== generated text:\n" + text, flush=True)


if __name__ == "__main__":
    main()
