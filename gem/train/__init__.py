"""Training: ``train(cfg)`` (gem.train.trainer) and its parts."""


def train(cfg):
    from gem.train.trainer import train as _train

    return _train(cfg)
