"""Megatron's REST text-generation server: ``torchrun ... tools/run_text_generation_server.py <model flags>
--load CKPT [--port 5000]``; then ``PUT http://host:port/api`` with ``{"prompts": [...], "tokens_to_generate": N}``
or open ``http://host:port/`` in a browser. Rank 0 serves HTTP; the other ranks follow its broadcasts."""
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.inference.checkpoint_model import initialize_and_load, is_driver_rank  # noqa: E402
from megatron.inference.text_generation_server import MegatronServer, follower_loop  # noqa: E402
from megatron.training.errors import exit_on_configuration_error  # noqa: E402


@exit_on_configuration_error()
def main():
    model = initialize_and_load()
    from megatron.training import get_args, get_tokenizer

    args = get_args()
    if is_driver_rank():
        if args.world_size != args.tensor_model_parallel_size * args.pipeline_model_parallel_size:
            print("WARNING: data-parallel replicas are idle in the text generation server", flush=True)
        defaults = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
        server = MegatronServer(model, defaults, tokenizer=get_tokenizer(),
                                max_position_embeddings=args.max_position_embeddings)
        print(f"text generation server: http://{args.host}:{args.port}/ (PUT /api)", flush=True)
        server.run(args.host, args.port)
    else:
        follower_loop(model)


if __name__ == "__main__":
    main()
