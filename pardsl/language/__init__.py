"""The language: the .par grammar's parser, diagnostics located in the file, and progress reports."""
