"""`tandem.batch`: offline inference over Ray Data, shaped like `ray.data.llm`, a public contract.

    from tandem.batch import ProcessorConfig, build_processor

The implementation lives in `deploy/batch/`; `tandem batch -i IN -o OUT --model M` runs OpenAI batch files.
"""

from tandem.deploy.batch.config import ProcessorConfig
from tandem.deploy.batch.processor import Processor, build_processor

__all__ = ["Processor", "ProcessorConfig", "build_processor"]
