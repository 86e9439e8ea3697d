"""dual-sampling: generate text from the geometric mixture of a teacher and a theta (student) model."""
