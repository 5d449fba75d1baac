"""The core: what a graph is, independent of any device. GGUF types and quantization
(:mod:`.types`), tensor descriptions (:mod:`.tensor`: ggml's ne/nb; data movement is the
runtime's), the op catalog (:mod:`.ops`), the graph builder (:mod:`.graph`) and the fusion rules
(:mod:`.fusion`). Nothing here imports the runtime or anything above it."""
