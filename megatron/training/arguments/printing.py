"""The arguments table, printed as Megatron-LM prints it (rank 0 only)."""
from __future__ import annotations


def format_args_table(title: str, args) -> str:
    # Megatron sorts the formatted lines (not the names) case-insensitively; the two orders agree
    # because a name is always followed by a space, which sorts before every character of a name.
    rows = [f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()]
    lines = [f"------------------------ {title} ------------------------"]
    lines.extend(sorted(rows, key=lambda row: row.lower()))
    lines.append(f"-------------------- end of {title} ---------------------")
    return "\n".join(lines)


def _print_args(title, args):
    """Print ``args`` sorted case-insensitively between Megatron's header and footer lines, on rank 0."""
    if getattr(args, "rank", 0) == 0:
        print(format_args_table(title, args), flush=True)
