package postgres

// A batch's parameters: each column of its rows, an array that pgx
// encodes element by element. pgx's own slices ([]string, [][]byte,
// []int64) box every element into an interface to encode it, an
// allocation each (by reflection for [][]byte): some thirty a first
// execution. A column gives pgx a pointer to each element instead, which
// boxes for free, of a type that encodes itself through pgtype's valuer
// interfaces.

import (
	"context"

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

// registerColumns tells m the SQL types of the columns, which the exec
// modes that do not ask the server for the parameters' types (exec,
// simple_protocol) find by the Go type: the columns of the batch
// statements, always sent as arrays (inputRows).
func registerColumns(m *pgtype.Map) {
	m.RegisterDefaultPgType(column[bytesParam](nil), "_bytea")
	m.RegisterDefaultPgType(column[textParam](nil), "_text")
	m.RegisterDefaultPgType(column[int8Param](nil), "_int8")
	m.RegisterDefaultPgType(column[int4Param](nil), "_int4")
	m.RegisterDefaultPgType(column[boolParam](nil), "_bool")
}

// afterConnect is the pools' AfterConnect: every connection's type map
// knows the columns.
func afterConnect(_ context.Context, c *pgx.Conn) error {
	registerColumns(c.TypeMap())
	return nil
}
