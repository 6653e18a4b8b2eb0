"""Training with psparse and without it: the built-in loop, the DDP baselines, the models.

* ``loop.py``: ``psparse-worker``, the built-in training loop (a user of ``psparse.connect``);
* ``ddp.py``: the baselines users would pick instead, DDP and DDP + PowerSGD;
* ``models.py``: LeNet-5, ResNet-20, an MLP, ``synthetic``, or ``package.module:factory``.

The data sets are ``psparse/data/`` (a folder of its own: users import it).
"""
