"""shmkv for vLLM (extra ``shmkv[vllm]``): ``ShmkvConnector``, a KV connector (v1 API)
through which every vLLM instance on the host naming the same segment shares one prefix
cache.  Select it with ``KVTransferConfig(kv_connector="ShmkvConnector",
kv_connector_module_path="shmkv.integrations.vllm", kv_role="kv_both",
kv_load_failure_policy="recompute", kv_connector_extra_config={"segment": NAME})``.

Importing this package imports vLLM; ``import shmkv`` never does.
"""
from .connector import ShmkvConnector, ShmkvConnectorMetadata, request_salt

__all__ = ["ShmkvConnector", "ShmkvConnectorMetadata", "request_salt"]
