"""The DCP glue: StorageWriter/StorageReader subclasses over the pipeline and storage layers."""
