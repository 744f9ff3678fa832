"""admin_env_key_label: a COSERVE_ADMIN_KEY's row shows a label derived from its hash, not its first characters

An admin key registered from COSERVE_ADMIN_KEY kept its first 10 characters in clear as its prefix (all of a
short key). Such rows, the admin keys whose prefix is not a generated key's ("cs-"), now show "env:" and four
hex digits of the key's hash; the label also marks them as the variable's, so a start with a changed variable
revokes them.

Revision ID: 0031
Revises: 0030
Create Date: 2026-11-29 02:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0031'
down_revision: str | Sequence[str] | None = '0030'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

api_keys = sa.table('api_keys', sa.column('prefix', sa.String), sa.column('key_hash', sa.String),
                    sa.column('is_admin', sa.Boolean))


def upgrade() -> None:
    op.execute(api_keys.update()
               .where(api_keys.c.is_admin.is_(sa.true()), api_keys.c.prefix.not_like('cs-%'),
                      api_keys.c.prefix.not_like('env:%'))
               .values(prefix=sa.literal('env:') + sa.func.substr(api_keys.c.key_hash, 1, 4)))


def downgrade() -> None:
    pass  # the characters the rows showed are gone, as they should be
