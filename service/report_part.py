"""The base of every part of the run report (docs/report.md): a typed pydantic model,
written as JSON once, and read by attribute or by its JSON key.

The report and each of its sections (``onnx``, ``int8``, ``evaluation``, ``job``, ...) are
:class:`ReportPart` models, so a section is one typed object from the phase that makes it
to the file, and ``report.json`` is one ``model_dump``. Item access (``report["layers"][0]
["class"]``) is the same typed object looked up by its JSON key: it reads ``report.json``
and the object alike, which the Python API's users do (docs/python.md), and it copies
nothing. Fields a reader of an older or newer report does not know are kept as they came
(``extra="allow"``) and written back unchanged.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer


class ReportPart(BaseModel):
    """A typed part of the report. ``OMIT_WHEN_NONE`` names the fields the JSON leaves out
    when they are None (a section a run did not have, an entry only some runs write); every
    other None is written as ``null``."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    OMIT_WHEN_NONE: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _leave_out_absent(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        for name in self.OMIT_WHEN_NONE:
            key = _json_key(type(self), name)
            if key in data and data[key] is None:
                del data[key]
        return data

    def to_dict(self) -> dict[str, Any]:
        """The part as JSON-ready data (JSON keys, the fields in their declared order)."""
        return self.model_dump(mode="json", by_alias=True)

    def __getitem__(self, key: str) -> Any:
        """The field whose JSON key is ``key`` (``KeyError`` when the JSON has no such key)."""
        name = _field_name(type(self), key)
        if name is None:
            extra = self.__pydantic_extra__ or {}
            if key in extra:
                return extra[key]
            raise KeyError(key)
        value = getattr(self, name)
        if value is None and name in self.OMIT_WHEN_NONE:
            raise KeyError(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        """The field whose JSON key is ``key``, or ``default`` when the JSON leaves it out."""
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key, _MISSING) is not _MISSING


_MISSING = object()


def _json_key(kind: type[BaseModel], name: str) -> str:
    field = kind.model_fields[name]
    return field.alias or name


def _field_name(kind: type[BaseModel], key: str) -> str | None:
    for name, field in kind.model_fields.items():
        if (field.alias or name) == key:
            return name
    return None
