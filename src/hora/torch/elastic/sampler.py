"""``ElasticSampler`` where Horovod keeps it (``horovod.torch.elastic.sampler``)."""

from hora.torch.sampler import ElasticSampler

__all__ = ["ElasticSampler"]
