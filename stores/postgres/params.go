package postgres

// A batch's parameters: each column of its rows, an array. pgx's own
// slices ([]string, [][]byte, []int64) are encoded element by element,
// each boxed into an interface (an allocation, by reflection for
// [][]byte), type-tested and encoded through a plan, into a buffer that
// grows by doubling from 256 bytes at every statement: a batch's bodies
// were copied some seven times. A column is encoded in one pass instead,
// into a buffer grown once to its size (columnCodec), in the binary
// format that pgx's default mode and cache_describe send. For the text
// format (the exec and simple_protocol modes), it is a
// pgtype.ArrayGetter whose elements encode themselves through pgtype's
// valuer interfaces, given as pointers, which box for free.

import (
	"context"
	"encoding/binary"
	"math"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// The elements of the columns, each with what pgx encodes it as.
type (
	bytesParam []byte
	textParam  string
	int8Param  int64
	int4Param  int32
	boolParam  bool
)

func (p *bytesParam) BytesValue() ([]byte, error) { return *p, nil }
func (p *textParam) TextValue() (pgtype.Text, error) {
	return pgtype.Text{String: string(*p), Valid: true}, nil
}
func (p *int8Param) Int64Value() (pgtype.Int8, error) {
	return pgtype.Int8{Int64: int64(*p), Valid: true}, nil
}
func (p *int4Param) Int64Value() (pgtype.Int8, error) {
	return pgtype.Int8{Int64: int64(*p), Valid: true}, nil
}
func (p *boolParam) BoolValue() (pgtype.Bool, error) {
	return pgtype.Bool{Bool: bool(*p), Valid: true}, nil
}
func (p bytesParam) value() any { return []byte(p) }
func (p textParam) value() any  { return string(p) }
func (p int8Param) value() any  { return int64(p) }
func (p int4Param) value() any  { return int32(p) }
func (p boolParam) value() any  { return bool(p) }

// param is an element type of a column.
type param interface {
	bytesParam | textParam | int8Param | int4Param | boolParam
	// value is the element as the Go value that pgx encodes as the
	// same SQL type: the form of a statement for one request takes the
	// row's values themselves.
	value() any
	// binarySize is the size of the element in an array in the binary
	// format, its length included, and appendBinary appends it so.
	binarySize() int
	appendBinary(buf []byte) []byte
}

func (p bytesParam) binarySize() int { return 4 + len(p) }
func (p textParam) binarySize() int  { return 4 + len(p) }
func (int8Param) binarySize() int    { return 4 + 8 }
func (int4Param) binarySize() int    { return 4 + 4 }
func (boolParam) binarySize() int    { return 4 + 1 }

func (p bytesParam) appendBinary(buf []byte) []byte {
	if p == nil {
		return binary.BigEndian.AppendUint32(buf, math.MaxUint32) // NULL: a length of -1
	}
	return append(binary.BigEndian.AppendUint32(buf, uint32(len(p))), p...)
}

func (p textParam) appendBinary(buf []byte) []byte {
	return append(binary.BigEndian.AppendUint32(buf, uint32(len(p))), p...)
}

func (p int8Param) appendBinary(buf []byte) []byte {
	return binary.BigEndian.AppendUint64(binary.BigEndian.AppendUint32(buf, 8), uint64(p))
}

func (p int4Param) appendBinary(buf []byte) []byte {
	return binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(buf, 4), uint32(p))
}

func (p boolParam) appendBinary(buf []byte) []byte {
	b := byte(0)
	if p {
		b = 1
	}
	return append(binary.BigEndian.AppendUint32(buf, 1), b)
}

// column is one column of a batch's rows, a pgtype.ArrayGetter.
type column[E param] []E

func (c column[E]) Dimensions() []pgtype.ArrayDimension {
	if c == nil {
		return nil
	}
	return []pgtype.ArrayDimension{{Length: int32(len(c)), LowerBound: 1}}
}

func (c column[E]) Index(i int) any { return &c[i] }
func (c column[E]) IndexType() any  { return new(E) }

// first is the column's first element, as its Go value (param.value).
func (c column[E]) first() any { return c[0].value() }

// appendBinary appends c as an array of elemOID in the binary format:
// its header (dimensions, whether any element is NULL, the element
// type, then each dimension's length and lower bound), then its
// elements.
func (c column[E]) appendBinary(buf []byte, elemOID uint32) []byte {
	size, null := 20, false
	for _, e := range c {
		size += e.binarySize()
		if b, ok := any(e).(bytesParam); ok && b == nil {
			null = true
		}
	}
	buf = slices.Grow(buf, size)
	if len(c) == 0 {
		return binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint64(buf, 0), elemOID)
	}
	buf = binary.BigEndian.AppendUint32(buf, 1)
	if null {
		buf = binary.BigEndian.AppendUint32(buf, 1)
	} else {
		buf = binary.BigEndian.AppendUint32(buf, 0)
	}
	buf = binary.BigEndian.AppendUint32(buf, elemOID)
	buf = binary.BigEndian.AppendUint32(buf, uint32(len(c)))
	buf = binary.BigEndian.AppendUint32(buf, 1)
	for _, e := range c {
		buf = e.appendBinary(buf)
	}
	return buf
}

// binaryColumn is a column, whatever its element type.
type binaryColumn interface {
	appendBinary(buf []byte, elemOID uint32) []byte
}

// columnCodec is pgx's codec of an array type (Codec), which encodes the
// columns in the binary format itself (column.appendBinary) and leaves
// everything else to pgx's.
type columnCodec struct {
	pgtype.Codec
	elemOID uint32
}

func (c columnCodec) PlanEncode(m *pgtype.Map, oid uint32, format int16, value any) pgtype.EncodePlan {
	if _, ok := value.(binaryColumn); ok && format == pgtype.BinaryFormatCode {
		return columnPlan(c.elemOID)
	}
	return c.Codec.PlanEncode(m, oid, format, value)
}

// columnPlan encodes a column as an array of the element type it is.
type columnPlan uint32

func (p columnPlan) Encode(value any, buf []byte) ([]byte, error) {
	return value.(binaryColumn).appendBinary(buf, uint32(p)), nil
}

// registerColumns has m encode the columns of the batch statements
// (always sent as arrays, inputRows) with columnCodec, and tells it their
// SQL types, which the exec modes that do not ask the server for the
// parameters' types (exec, simple_protocol) find by the Go type.
func registerColumns(m *pgtype.Map) {
	for _, c := range []struct {
		array   string
		elemOID uint32
		goType  any
	}{
		{"_bytea", pgtype.ByteaOID, column[bytesParam](nil)},
		{"_text", pgtype.TextOID, column[textParam](nil)},
		{"_int8", pgtype.Int8OID, column[int8Param](nil)},
		{"_int4", pgtype.Int4OID, column[int4Param](nil)},
		{"_bool", pgtype.BoolOID, column[boolParam](nil)},
	} {
		if t, ok := m.TypeForName(c.array); ok {
			m.RegisterType(&pgtype.Type{Name: t.Name, OID: t.OID, Codec: columnCodec{Codec: t.Codec, elemOID: c.elemOID}})
		}
		m.RegisterDefaultPgType(c.goType, c.array)
	}
}

// afterConnect is the pools' AfterConnect: every connection's type map
// knows the columns.
func afterConnect(_ context.Context, c *pgx.Conn) error {
	registerColumns(c.TypeMap())
	return nil
}
