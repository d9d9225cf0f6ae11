"""vLLM general plugin (entry-point group `vllm.general_plugins`, name `llep`): vLLM calls register() in every process
before it builds the model, so its `deepep_low_latency` all2all backend (`import deep_ep`) gets llep's Buffer."""
from llep.integrations import install_as_deep_ep


def register() -> None:
    install_as_deep_ep()
