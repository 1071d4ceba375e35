"""A model module that fails while being imported, as a user's module with a bug would."""
raise RuntimeError("this module fails at import (test)")
