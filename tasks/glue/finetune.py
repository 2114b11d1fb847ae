"""GLUE finetuning (``--task MNLI`` or ``QQP``): the ``Classification`` model (BERT + pooler + linear head with
3 / 2 classes) trained on ``--train-data`` files, accuracy on each ``--valid-data`` file after every epoch."""
from __future__ import annotations

from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.utils import print_rank_0
from tasks.eval_utils import accuracy_func_provider
from tasks.finetune_utils import finetune
from tasks.glue.data import name_from_datapath


def glue_classification(num_classes, Dataset, name_from_datapath_func):
    def train_valid_datasets_provider():
        args, tokenizer = get_args(), get_tokenizer()
        train_dataset = Dataset("training", args.train_data, tokenizer, args.seq_length)
        valid_dataset = Dataset("validation", args.valid_data, tokenizer, args.seq_length)
        return train_dataset, valid_dataset

    def model_provider(pre_process=True, post_process=True):
        from megatron.legacy.model.classification import Classification

        args = get_args()
        print_rank_0("building classification model for {} ...".format(args.task))
        return Classification(config=core_transformer_config_from_args(args), num_classes=num_classes,
                              num_tokentypes=2, pre_process=pre_process, post_process=post_process)

    def metrics_func_provider():
        args, tokenizer = get_args(), get_tokenizer()

        def single_dataset_provider(datapath):
            return Dataset(name_from_datapath_func(datapath), [datapath], tokenizer, args.seq_length)

        return accuracy_func_provider(single_dataset_provider)

    finetune(train_valid_datasets_provider, model_provider, end_of_epoch_callback_provider=metrics_func_provider)


def glue_task(task):
    """(number of classes, dataset class) of a GLUE task name."""
    if task == "MNLI":
        from tasks.glue.mnli import LABELS, MNLIDataset
        return len(LABELS), MNLIDataset
    if task == "QQP":
        from tasks.glue.qqp import LABELS, QQPDataset
        return len(LABELS), QQPDataset
    raise NotImplementedError("GLUE task {} is not implemented.".format(task))


def main():
    args = get_args()
    num_classes, Dataset = glue_task(args.task)
    glue_classification(num_classes, Dataset, lambda datapath: name_from_datapath(datapath, args.task))
