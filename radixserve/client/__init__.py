"""The caller side of the engine pipe: EngineClient and its in-process and multiprocess
implementations, RequestBuilder (API arguments -> RequestSpecs), result merging,
detokenization, output shaping, and the offline `Engine` API built on them."""
