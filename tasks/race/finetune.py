"""RACE finetuning (``--task RACE``): the ``MultipleChoice`` model (BERT + pooler + ``Linear(h, 1)`` per choice)
trained on the ``--train-data`` directories, accuracy on each ``--valid-data`` directory after every epoch."""
from __future__ import annotations

from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.utils import print_rank_0
from tasks.eval_utils import accuracy_func_provider
from tasks.finetune_utils import finetune
from tasks.race.data import RaceDataset, name_from_datapath


def train_valid_datasets_provider():
    args, tokenizer = get_args(), get_tokenizer()
    train_dataset = RaceDataset("training", args.train_data, tokenizer, args.seq_length)
    valid_dataset = RaceDataset("validation", args.valid_data, tokenizer, args.seq_length)
    return train_dataset, valid_dataset


def model_provider(pre_process=True, post_process=True):
    from megatron.legacy.model.multiple_choice import MultipleChoice

    print_rank_0("building multichoice model for RACE ...")
    return MultipleChoice(config=core_transformer_config_from_args(get_args()), num_tokentypes=2,
                          pre_process=pre_process, post_process=post_process)


def metrics_func_provider():
    args, tokenizer = get_args(), get_tokenizer()

    def single_dataset_provider(datapath):
        return RaceDataset(name_from_datapath(datapath), [datapath], tokenizer, args.seq_length)

    return accuracy_func_provider(single_dataset_provider)


def main():
    finetune(train_valid_datasets_provider, model_provider, end_of_epoch_callback_provider=metrics_func_provider)
